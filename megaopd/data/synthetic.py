"""Synthetic arithmetic/algebra problems with worked solutions, and a tiny tokenizer: the CPU data world.

    python tools/build_tiny_data.py            # writes examples/tiny/data/ and examples/tiny/tokenizer/
    python tools/build_tiny_data.py --check    # rebuilds into a temp dir, fails unless byte-identical

Problems (deterministic given the seed), each with a step-by-step trace in DeepSeek-R1 style
"<think>\\n<steps>\\n</think>\\nThe answer is \\boxed{<answer>}." of ~30-90 tokens of the tiny tokenizer:
  expr     evaluate an integer expression with 2-4 operations (+ - * /, minimal parentheses);
  linear   solve a*x + b = c;
  linear2  solve a*x + b = c*x + d;
  word     a two- or three-step word problem.
Rows follow the OpenR1-Math-220k schema (problem, solution, answer, problem_type, question_type, source,
uuid, is_reasoning_complete, generations, correctness_math_verify, finish_reasons, correctness_count).
A share of the training rows carries a second, wrong generation (one arithmetic slip, propagated), so the
golden filter has something to drop; correctness_math_verify is math-verify's judgement of every
generation, and a row whose judgements disagree with the construction is not emitted.

Tokenizer: byte-free character BPE trained on the corpus (printable ASCII + newline as the alphabet, digits
always single tokens so numbers stay compositional), 256 ids in all: <|endoftext|> (pad) 0, <|im_start|> 1,
<|im_end|> (EOS) 2, <|unk|> 3, merges, then the think markers <think> and </think> as added tokens;
Qwen-like chat template without a default system prompt.

Run time (shared 2-core CPU): 15-20 s for the default 4000/2000/200 rows (math-verify judging ~7000
generations, then the BPE training), and the same for --check. Output: ~3.8 MB of jsonl + a 20 KB tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import re
import uuid as uuidlib
from dataclasses import dataclass
from typing import Optional, Sequence

from megaopd.data.config import DEFAULT_INSTRUCTION
from megaopd.data.openr1 import answer_matches

SOURCE = "megaopd_synthetic"
KINDS = (("expr", 0.4), ("linear", 0.2), ("linear2", 0.15), ("word", 0.25))
UUID_NAMESPACE = uuidlib.UUID("6d656761-6f70-4464-9174-696e79646174")

PAD, BOS_TURN, EOS, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
THINK, END_THINK = "<think>", "</think>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOKENIZER_VOCAB = 256


@dataclass(frozen=True)
class Problem:
    kind: str
    text: str
    steps: tuple[str, ...]
    answer: int
    wrong_steps: Optional[tuple[str, ...]] = None
    """The same steps with one slip (propagated), when a slip keeps every number an integer."""
    wrong_answer: Optional[int] = None


# ---------------------------------------------------------------- expressions
PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _apply(op: str, a: int, b: int) -> Optional[int]:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0 or a % b:
        return None  # only exact divisions: every intermediate value stays an integer
    return a // b


def _random_tree(rng: random.Random, n_ops: int):
    """A random expression tree: an int leaf or (op, left, right)."""
    if n_ops == 0:
        return rng.randint(1, 20)
    left = rng.randint(0, n_ops - 1)
    op = rng.choices("+-*/", weights=(4, 3, 3, 1))[0]
    return (op, _random_tree(rng, left), _random_tree(rng, n_ops - 1 - left))


def _render(node, parent_op: Optional[str] = None, right: bool = False) -> str:
    if isinstance(node, int):
        return str(node) if node >= 0 else f"({node})"
    op, a, b = node
    s = f"{_render(a, op, False)} {op} {_render(b, op, True)}"
    # Parentheses where precedence needs them, and around every right operand of equal precedence: then
    # reading left to right follows the tree, the order in which the trace evaluates it.
    if parent_op and (PREC[op] < PREC[parent_op] or (right and PREC[op] == PREC[parent_op])):
        s = f"({s})"
    return s


def _num(v: int) -> str:
    """An operand as written in a step: negative values in parentheses on the right of an operator."""
    return f"({v})" if v < 0 else str(v)


def _reduce_once(node, delta: int = 0):
    """Evaluates the first operation in post-order (leftmost with two number operands): returns the
    reduced tree and (a, op, b, value), or (tree, None) on an inexact division. delta is added to the
    value: the slip of a wrong trace."""
    op, a, b = node
    if isinstance(a, int) and isinstance(b, int):
        v = _apply(op, a, b)
        return (None, None) if v is None else (v + delta, (a, op, b, v + delta))
    if not isinstance(a, int):
        na, info = _reduce_once(a, delta)
        return ((op, na, b) if info else None), info
    nb, info = _reduce_once(b, delta)
    return ((op, a, nb) if info else None), info


def _evaluate(tree, slip: Optional[tuple[int, int]] = None) -> tuple[Optional[int], list[str], list[int]]:
    """(value, step lines, intermediate values): one operation per line, each followed by what is left
    ("7 + 5 = 12, which gives 12 * 3 - 4"). slip=(step, delta) adds delta to that step's result and
    computes the later steps correctly from it (a plausible wrong trace)."""
    steps, values, node = [], [], tree
    while not isinstance(node, int):
        delta = slip[1] if slip is not None and slip[0] == len(steps) else 0
        node, info = _reduce_once(node, delta)
        if info is None:
            return None, steps, values
        a, op, b, v = info
        line = f"{a} {op} {_num(b)} = {v}"
        steps.append(line if isinstance(node, int) else f"{line}, which gives {_render(node)}")
        values.append(v)
    return node, steps, values


def _expr_problem(rng: random.Random) -> Optional[Problem]:
    tree = _random_tree(rng, rng.randint(2, 4))
    value, steps, values = _evaluate(tree)
    if value is None or any(abs(v) > 500 for v in values):
        return None  # keep numbers small: a tiny model should be able to learn the arithmetic
    text = f"Compute {_render(tree)}."
    slip = (rng.randrange(len(steps)), rng.choice((-3, -2, -1, 1, 2, 3)))
    wrong_value, wrong, _ = _evaluate(tree, slip)
    if wrong_value is None or wrong_value == value:
        return Problem("expr", text, tuple(steps), value)
    return Problem("expr", text, tuple(steps), value, tuple(wrong), wrong_value)


# ---------------------------------------------------------------- equations
def _signed(v: int) -> str:
    return f"+ {v}" if v >= 0 else f"- {-v}"


def _linear_steps(a: int, move: str, rhs_terms: str, rhs: int) -> list[str]:
    """The steps after the first: isolate a*x, then divide."""
    return [
        f"{move}: {a}x = {rhs_terms}",
        f"{a}x = {rhs}",
        f"Divide both sides by {a}: x = {rhs} / {a}",
        f"x = {rhs // a}",
    ]


def _linear_problem(rng: random.Random) -> Problem:
    a, x, b = rng.randint(2, 9), rng.randint(-9, 12), rng.choice([i for i in range(-20, 21) if i])
    c = a * x + b
    text = f"Solve for x: {a}x {_signed(b)} = {c}."
    move = f"Subtract {b} from both sides" if b > 0 else f"Add {-b} to both sides"
    rhs_terms = f"{c} {'-' if b > 0 else '+'} {abs(b)}"
    steps = _linear_steps(a, move, rhs_terms, c - b)
    d = a * rng.choice((-2, -1, 1, 2))  # a slip by a multiple of a keeps x an integer
    wrong = [steps[0]] + _linear_steps(a, move, rhs_terms, c - b + d)[1:]
    return Problem("linear", text, tuple(steps), x, tuple(wrong), x + d // a)


def _linear2_problem(rng: random.Random) -> Optional[Problem]:
    c = rng.randint(1, 7)
    a = c + rng.randint(2, 6)  # a - c >= 2: no "1x" and no division by 1
    x, b = rng.randint(-9, 12), rng.randint(-15, 15)
    d = (a - c) * x + b
    if b == 0 or d == 0:
        return None  # "+ 0" terms read oddly; draw again
    text = f"Solve for x: {a}x {_signed(b)} = {c}x {_signed(d)}."
    k = a - c
    first = f"Move x to the left and numbers to the right: {a}x - {c}x = {d} {'-' if b > 0 else '+'} {abs(b)}"
    steps = [first] + _linear_steps(k, "", "", d - b)[1:]
    slip = k * rng.choice((-2, -1, 1, 2))
    wrong = [first] + _linear_steps(k, "", "", d - b + slip)[1:]
    return Problem("linear2", text, tuple(steps), x, tuple(wrong), x + slip // k)


# ---------------------------------------------------------------- word problems
NAMES = ("Ann", "Ben", "Cal", "Dee", "Eva", "Max", "Sam", "Zoe")
ITEMS = ("apples", "pens", "cards", "coins", "eggs", "books", "stamps", "shells")


def _word_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.randrange(3)
    if form == 0:
        a, b, c = rng.randint(2, 30), rng.randint(2, 6), rng.randint(2, 9)
        d = rng.randint(1, a + b * c - 1)
        text = (
            f"{name} has {a} {item}, buys {b} bags of {c} {item} each and gives away {d}. "
            f"How many {item} does {name} have now?"
        )
        ops = [(b, "*", c), (a, "+", b * c), (a + b * c, "-", d)]
        labels = ("In the bags", "Before giving", "Now")
    elif form == 1:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        c = rng.randint(1, a * b - 1)
        text = f"A box holds {a} rows of {b} {item}. {name} takes {c} {item}. How many {item} are left?"
        ops = [(a, "*", b), (a * b, "-", c)]
        labels = ("In the box", "Left")
    else:
        a, b, c = rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 20)
        text = f"{name} reads {a} pages a day for {b} days, then {c} more pages. How many pages in all?"
        ops = [(a, "*", b), (a * b, "+", c)]
        labels = (f"In {b} days", "In all")
    steps, wrong = [], []
    slip_at, delta = rng.randrange(len(ops)), rng.choice((-2, -1, 1, 2))
    carry_right = None
    carry_wrong = None
    for i, (x, op, y) in enumerate(ops):
        # Each step uses the previous step's result as its left operand (except the first two of form 0,
        # where the product feeds the right operand of the sum).
        if i == 0:
            xr, yr = x, y
        elif form == 0 and i == 1:
            xr, yr = x, carry_right
        else:
            xr, yr = carry_right, y
        v = _apply(op, xr, yr)
        steps.append(f"{labels[i]}: {xr} {op} {yr} = {v}")
        if i == 0:
            xw, yw = x, y
        elif form == 0 and i == 1:
            xw, yw = x, carry_wrong
        else:
            xw, yw = carry_wrong, y
        w = _apply(op, xw, yw) + (delta if i == slip_at else 0)
        wrong.append(f"{labels[i]}: {xw} {op} {_num(yw)} = {w}")
        carry_right, carry_wrong = v, w
    return Problem("word", text, tuple(steps), carry_right, tuple(wrong), carry_wrong)


MAKERS = {"expr": _expr_problem, "linear": _linear_problem, "linear2": _linear2_problem, "word": _word_problem}


def make_problem(rng: random.Random) -> Optional[Problem]:
    """One random problem, or None when the draw was rejected (numbers too big, inexact division)."""
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    return MAKERS[kind](rng)


# ---------------------------------------------------------------- rows
def trace(steps: Sequence[str], answer: int) -> str:
    """The R1-style generation: think block with the steps, then the boxed answer."""
    return f"{THINK}\n" + "\n".join(steps) + f"\n{END_THINK}\nThe answer is \\boxed{{{answer}}}."


def make_row(p: Problem, rng: random.Random, seed: int, wrong_rate: float) -> Optional[dict]:
    """An OpenR1-Math-schema row; every generation judged by math-verify. None if a judgement disagrees
    with how the generation was built (never seen; guards the data against a math-verify change)."""
    correct = trace(p.steps, p.answer)
    gens = [correct]
    if p.wrong_steps is not None and p.wrong_answer != p.answer and rng.random() < wrong_rate:
        wrong = trace(p.wrong_steps, p.wrong_answer)
        # The wrong trace comes first half of the time: golden_choice=first must look past it.
        gens = [wrong] + gens if rng.random() < 0.5 else gens + [wrong]
    answer = str(p.answer)
    verdicts = [answer_matches(answer, g) for g in gens]
    if verdicts != [g == correct for g in gens]:
        return None
    return {
        "problem": p.text,
        "solution": "\n".join(p.steps) + f"\nThe answer is ${answer}$.",
        "answer": answer,
        "problem_type": "Algebra" if p.kind.startswith("linear") else "Arithmetic",
        "question_type": "math-word-problem",
        "source": SOURCE,
        "uuid": str(uuidlib.uuid5(UUID_NAMESPACE, f"{seed}/{p.text}")),
        "is_reasoning_complete": [True] * len(gens),
        "generations": gens,
        "correctness_math_verify": verdicts,
        "finish_reasons": ["stop"] * len(gens),
        "correctness_count": sum(verdicts),
    }


def generate_splits(
    sizes: Sequence[tuple[str, int]], seed: int = 0, wrong_rate: float = 0.15, no_wrong: Sequence[str] = ("val",)
) -> dict[str, list[dict]]:
    """Unique problems (no problem text in two splits), cut into consecutive splits of the given sizes.
    Splits named in no_wrong get only the correct generation."""
    rng = random.Random(f"megaopd-synthetic/{seed}")
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for name, size in sizes:
        rows: list[dict] = []
        rate = 0.0 if name in no_wrong else wrong_rate
        attempts = 0
        while len(rows) < size:
            attempts += 1
            if attempts > 50 * size + 1000:
                raise RuntimeError(f"synthetic generator cannot find {size} unique problems for {name}")
            p = make_problem(rng)
            if p is None or p.text in seen:
                continue
            row = make_row(p, rng, seed, rate)
            if row is None:
                continue
            seen.add(p.text)
            rows.append(row)
        out[name] = rows
    return out


# ---------------------------------------------------------------- tokenizer
def tokenizer_corpus(rows: Sequence[dict], instruction: str = DEFAULT_INSTRUCTION) -> list[str]:
    """The texts the tokenizer is trained on, cut as the tokenizer will meet them: the pieces between
    special/added tokens of rendered prompts (DataConfig's default user_format) and of generations."""
    texts = []
    for r in rows:
        texts.append(f"user\n{r['problem']}\n{instruction}")
        texts.append("assistant\n")
        for g in r["generations"]:
            texts.extend(piece for piece in re.split(f"{re.escape(THINK)}|{re.escape(END_THINK)}", g) if piece)
    return texts


def build_tokenizer(corpus: Sequence[str], vocab_size: int = TOKENIZER_VOCAB, spaces_lead: bool = False):
    """A PreTrainedTokenizerFast: character BPE over printable ASCII + newline, single-digit numbers.
    spaces_lead: also cut the text before every space, so a space only begins a token (" to", " both"; the
    tiny teacher with another tokenizer, tools/build_tiny_models.py --xtok); by default merges may end in a
    space too ("d ", " to ")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(i) for i in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Digits are split before BPE so that no merge swallows a number: the model sees 1 2 7, not "127".
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    if spaces_lead:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(" ", behavior="merged_with_next"), pre_tokenizers.Digits(individual_digits=True)]
        )
    tok.decoder = decoders.Fuse()  # tokens are pieces of the text itself: decode by concatenation
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        special_tokens=[PAD, BOS_TURN, EOS, UNK],
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer)
    # Not special: decode(skip_special_tokens=True) keeps the think block, as Qwen3's tokenizer does.
    tok.add_tokens(
        [AddedToken(THINK, special=False, normalized=False), AddedToken(END_THINK, special=False, normalized=False)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def save_tokenizer(tokenizer, out_dir: str) -> None:
    """save_pretrained, then tokenizer_config.json rewritten with sorted keys and the class name that
    transformers 4.x and 5.x both load (5.x writes its own backend name, which 4.x does not know)."""
    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg["chat_template"] = CHAT_TEMPLATE  # 4.x reads it from here; 5.x from chat_template.jinja
    with open(path, "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


__all__ = [
    "Problem",
    "make_problem",
    "make_row",
    "generate_splits",
    "trace",
    "tokenizer_corpus",
    "build_tokenizer",
    "save_tokenizer",
    "CHAT_TEMPLATE",
    "SOURCE",
]
