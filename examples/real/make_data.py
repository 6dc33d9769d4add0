"""Arithmetic word problems with worked golden solutions for the real-model example (examples/real/README.md).

    python examples/real/make_data.py            # writes examples/real/data/{train,val}.jsonl (seeded: the same files)

Each row is in the prepared format the loaders read (megaopd/data/openr1.py): `problem`, `answer` and a
`golden` solution, plus `id` and `uuid`; validation reads `problem` and `answer` from the same rows. Six
kinds of one- and two-step problems (add, take away, groups of, share equally, buy packs then give away,
get then lose) over small whole numbers, so that a 135M chat model has a chance. A golden shows each step
as an equation and ends with "The answer is N." with N a plain number: `metrics.reward.extract: number`
reads it (the last number after "answer"); nothing is boxed, because SmolLM2 never boxes.

Pure Python (random with a fixed seed); validation problems never repeat a training problem's text.
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Zoe", "Ivan", "Nora", "Sam", "Emma"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards", "shells", "coins"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _add(r: random.Random) -> tuple[str, str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(3, 60), r.randint(2, 40)
    return (
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        f"{name} starts with {a} {item} and gets {b} more.\n{a} + {b} = {a + b}",
        a + b,
    )


def _subtract(r: random.Random) -> tuple[str, str, int]:
    name, item, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 40)
    a = b + r.randint(1, 50)
    return (
        f"{name} had {a} {item} and gave away {b}. How many {item} does {name} have left?",
        f"{name} had {a} {item} and gave away {b}.\n{a} - {b} = {a - b}",
        a - b,
    )


def _groups(r: random.Random) -> tuple[str, str, int]:
    item, a, b = r.choice(ITEMS), r.randint(2, 12), r.randint(2, 12)
    return (
        f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?",
        f"{a} boxes with {b} {item} each.\n{a} * {b} = {a * b}",
        a * b,
    )


def _share(r: random.Random) -> tuple[str, str, int]:
    name, item, each, friends = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 12), r.randint(2, 9)
    total = each * friends
    return (
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
        f"{total} {item} shared among {friends} friends.\n{total} / {friends} = {each}",
        each,
    )


def _packs_then_give(r: random.Random) -> tuple[str, str, int]:
    name, item, packs, per = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 9), r.randint(2, 10)
    bought = packs * per
    gave = r.randint(1, bought - 1)
    return (
        f"{name} buys {packs} packs of {item} with {per} in each pack, then gives away {gave}. "
        f"How many {item} does {name} have left?",
        f"{name} buys {packs} packs of {per}.\n{packs} * {per} = {bought}\n"
        f"Then {name} gives away {gave}.\n{bought} - {gave} = {bought - gave}",
        bought - gave,
    )


def _get_then_lose(r: random.Random) -> tuple[str, str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(3, 40), r.randint(2, 30)
    c = r.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} does {name} have now?",
        f"{name} has {a} {item} and finds {b} more.\n{a} + {b} = {a + b}\n"
        f"Then {name} loses {c}.\n{a + b} - {c} = {a + b - c}",
        a + b - c,
    )


KINDS = [_add, _subtract, _groups, _share, _packs_then_give, _get_then_lose]


def make_rows(n: int, r: random.Random, split: str, seen: set[str]) -> list[dict]:
    """n rows of the given split, cycling through the kinds; skips problem texts already in `seen`."""
    rows = []
    while len(rows) < n:
        problem, steps, answer = KINDS[len(rows) % len(KINDS)](r)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append(
            {
                "id": f"{split}-{len(rows)}",
                "uuid": f"real-arith-{split}-{len(rows)}",
                "problem": problem,
                "answer": str(answer),
                "golden": f"{steps}\nThe answer is {answer}.",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=600, help="training problems (default 600)")
    p.add_argument("--val", type=int, default=60, help="validation problems (default 60)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--out", default=os.path.join(HERE, "data"))
    args = p.parse_args(argv)
    r, seen = random.Random(args.seed), set()
    # validation first, so that changing --train never changes the validation set
    splits = {"val": make_rows(args.val, r, "val", seen)}
    splits["train"] = make_rows(args.train, r, "train", seen)
    os.makedirs(args.out, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(args.out, f"{split}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{path}: {len(rows)} problems")


if __name__ == "__main__":
    main()
