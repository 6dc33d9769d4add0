"""The calculator tool: arithmetic parsed with Python's own parser into a tree, then evaluated node by node
over a whitelist (numbers, + - * / // % **, unary signs, parentheses). Never eval'd: a name, a call, an
attribute or any other node is an error, and so is a result too large to print (2 ** 10 ** 9 would stall
the rollout), so a tool call cannot run code or stop the run.

    calculate("12 * (3 + 4)")      -> "84"
    calculate("7 / 2")             -> "3.5"
    calculate("__import__('os')")  raises ToolError("unsupported expression: a call")
"""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NODE_NAMES = {
    ast.Call: "a call",
    ast.Name: "a name",
    ast.Attribute: "an attribute",
    ast.Subscript: "a subscript",
    ast.Compare: "a comparison",
    ast.BoolOp: "a boolean operator",
    ast.Lambda: "a lambda",
}


class ToolError(ValueError):
    """A tool call that cannot be answered; its message becomes the error observation the model reads."""


def calculate(expression: str, max_chars: int = 200, max_digits: int = 60) -> str:
    """The value of an arithmetic expression as text (integers exact; floats to 12 significant digits)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError('expression must be a non-empty string of arithmetic, e.g. "12 * (3 + 4)"')
    if len(expression) > max_chars:
        raise ToolError(f"expression longer than {max_chars} characters")
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    value = _value(tree.body, max_digits)
    return _format(value, max_digits)


def _value(node: ast.AST, max_digits: int):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        _check_size(node.value, max_digits)
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left, max_digits), _value(node.right, max_digits)
        if isinstance(node.op, ast.Pow):
            _check_power(a, b, max_digits)
        try:
            out = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise ToolError(f"arithmetic error: {e}") from None
        if isinstance(out, complex):
            raise ToolError("the result is not a real number")
        _check_size(out, max_digits)
        return out
    what = _NODE_NAMES.get(type(node), type(node).__name__)
    raise ToolError(f"unsupported expression: {what} (only numbers, + - * / // % ** and parentheses)")


def _check_power(base, exponent, max_digits: int) -> None:
    """Refuses a power whose result would exceed max_digits before computing it."""
    if abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > max_digits:
        raise ToolError(f"result too large (more than {max_digits} digits)")


def _check_size(value, max_digits: int) -> None:
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            raise ToolError("the result is not a finite number")
        if value != 0 and abs(value) >= 10**max_digits:
            raise ToolError(f"result too large (more than {max_digits} digits)")
    elif abs(value) >= 10**max_digits:
        raise ToolError(f"result too large (more than {max_digits} digits)")


def _format(value, max_digits: int) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 10**15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)
