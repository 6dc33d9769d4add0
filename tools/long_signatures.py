"""Lists the functions of a package that take many parameters (self and cls not counted): where a record or a
step context may read better than a long parameter list.

    python tools/long_signatures.py                 # megaopd/, 8 or more
    python tools/long_signatures.py megaopd/engine --min 6

A number is a smell detector, not a goal: some long lists are right where they are (Triton kernels and
autograd.Function.forward take flat tensors and constants by design).
"""

from __future__ import annotations

import argparse
import ast
import pathlib


def long_signatures(root: str, at_least: int) -> list[tuple[str, int, str, int]]:
    """(path, line, function name, parameter count) of every function under root with at least that many."""
    found = []
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                if len(names) >= at_least:
                    found.append((str(path), node.lineno, node.name, len(names)))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default="megaopd")
    ap.add_argument("--min", type=int, default=8, help="list functions with at least this many parameters")
    a = ap.parse_args()
    for path, line, name, n in long_signatures(a.root, a.min):
        print(f"{path}:{line} {name} {n}")


if __name__ == "__main__":
    main()
