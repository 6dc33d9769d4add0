"""The tiny CPU world of multi-turn tool use (examples/tiny/agentic.yaml): word problems with numbers too
large for the tiny models' mental arithmetic, tool-use traces, and an agentic teacher that learned to call
the calculator from them.

    python tools/build_tiny_agentic.py --data           # examples/tiny/agentic_data/{sft,opd,val}.jsonl
    python tools/build_tiny_agentic.py --data --check   # rebuild in a temp dir, exit 1 unless byte-identical
    python tools/build_tiny_agentic.py --teacher        # examples/tiny/models/agentic_teacher
    python tools/build_tiny_agentic.py --student        # examples/tiny/models/agentic_student
    python tools/build_tiny_agentic.py --eval DIR       # pass@1 with tools of an HF dir on the val problems

Problems (seeded): "A box holds 37 rows of 24 pens. ...", "Ann has 15 pens and buys 23 bags of 17 pens
each. ...", "Ann shares 912 pens equally among 24 friends. ...". The golden trace of each (its
`generations`, the OpenR1 schema, verified by math-verify) is one tool call and the final answer, in the
Qwen <tool_call> format and the tiny chat template's tool turn:

    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "37 * 24"}}\\n</tool_call><|im_end|>
    <|im_start|>tool\\n888<|im_end|>\\n<|im_start|>assistant\\nThe answer is \\boxed{888}.

The agentic teacher: the committed tiny teacher (examples/tiny/models/teacher; build_tiny_models.py) after
megaopd's own SFT on those traces (AGENTIC below); the agentic student: the committed tiny student after a
short cold start on them (STUDENT below: it calls the tool but gets half the answers wrong, which OPD from
the agentic teacher then improves). The golden traces' tool turns are masked out of the SFT loss (megaopd.data:
multi-turn goldens). Each build records its SFT curve, its pass@1 with tools before and after, and its
files' sha256 in examples/tiny/models/agentic_manifest.json. Measured here: teacher 524 s under a load of
10-15, student 53 s. --eval runs the multi-turn loop (megaopd.rollout.trajectories) with the embedded
engine and the calculator environment (EVAL below), as the trainer's validation does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid as uuidlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

DATA = os.path.join(ROOT, "examples", "tiny", "agentic_data")
MODELS = os.path.join(ROOT, "examples", "tiny", "models")
SIZES = (("sft", 3000), ("opd", 1000), ("val", 100))
SEED = 29
AGENTIC = {
    "steps": 150,
    "prompts_per_step": 8,
    "lr": 3e-3,
    "min_lr": 1e-4,
    "warmup_steps": 5,
    "decay": "cosine",
    "train_seed": 29,
}
STUDENT = {
    "steps": 60,
    "prompts_per_step": 8,
    "lr": 3e-3,
    "min_lr": 1e-4,
    "warmup_steps": 5,
    "decay": "cosine",
    "train_seed": 31,
}
"""The agentic student's cold start: short, so that it calls the tool but still gets many answers wrong
(copying the numbers), which is what OPD from the agentic teacher then has to teach."""
EVAL = {"temperature": 0.6, "max_new_tokens": 96, "max_turns": 3, "max_trajectory_tokens": 240, "seed": 0}
NAMES = ("Ann", "Ben", "Cal", "Dee", "Eva", "Max", "Sam", "Zoe")
ITEMS = ("apples", "pens", "cards", "coins", "eggs", "books", "stamps", "shells")
UUID_NAMESPACE = uuidlib.UUID("2b9c7c1e-29a0-4d0e-9a55-6b1d29c0ffee")


def log(msg: str) -> None:
    print(f"[build_tiny_agentic {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(text, calculator expression, answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.randrange(3)
    if form == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return f"A box holds {a} rows of {b} {item}. How many {item} are in the box?", f"{a} * {b}", a * b
    if form == 1:
        a, b, c = rng.randint(10, 99), rng.randint(11, 49), rng.randint(11, 49)
        return (
            f"{name} has {a} {item} and buys {b} bags of {c} {item} each. How many {item} does {name} have now?",
            f"{a} + {b} * {c}",
            a + b * c,
        )
    q, b = rng.randint(12, 99), rng.randint(12, 49)
    return (
        f"{name} shares {q * b} {item} equally among {b} friends. How many {item} does each friend get?",
        f"{q * b} / {b}",
        q,
    )


def trace(expression: str, answer: int) -> str:
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return (
        f"<tool_call>\n{call}\n</tool_call><|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is \\boxed{{{answer}}}."
    )


def rows(seed: int = SEED) -> dict[str, list[dict]]:
    rng, seen, out = random.Random(seed), set(), []
    total = sum(n for _, n in SIZES)
    while len(out) < total:
        text, expr, answer = problem(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append(
            {
                "problem": text,
                "solution": f"{expr} = {answer}\nThe answer is ${answer}$.",
                "answer": str(answer),
                "problem_type": "Arithmetic",
                "question_type": "math-word-problem",
                "source": "megaopd_agentic",
                "uuid": str(uuidlib.uuid5(UUID_NAMESPACE, f"{seed}/{text}")),
                "is_reasoning_complete": [True],
                "generations": [trace(expr, answer)],
                "correctness_math_verify": [True],
                "finish_reasons": ["stop"],
                "correctness_count": 1,
            }
        )
    splits, at = {}, 0
    for name, n in SIZES:
        splits[name] = out[at : at + n]
        at += n
    return splits


def write_data(data_dir: str) -> None:
    from megaopd.data.io import write_rows
    from megaopd.metrics.reward import math_verify_reward

    os.makedirs(data_dir, exist_ok=True)
    for name, rs in rows().items():
        bad = [r["uuid"] for r in rs[:50] if math_verify_reward(r["generations"][0], r["answer"]) != 1.0]
        if bad:
            raise SystemExit(f"math-verify does not accept the traces of {bad[:3]}")
        write_rows(os.path.join(data_dir, f"{name}.jsonl"), rs)


def check_data() -> int:
    from build_tiny_data import compare_dirs

    with tempfile.TemporaryDirectory() as tmp:
        write_data(tmp)
        problems = compare_dirs(DATA, tmp)
    if problems:
        print("agentic data check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("agentic data check passed")
    return 0


def evaluate_with_tools(hf_dir: str, problems: int = 100) -> dict:
    """pass@1 with tools and the tool-call rate on the first `problems` val problems (multi-turn loop)."""
    import torch

    from megaopd.data import PromptDataset
    from megaopd.data.config import DataConfig, SourceConfig
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.envs import EnvConfig
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.rollout.protocol import SamplingParams
    from megaopd.rollout.trajectories import MultiTurn

    torch.set_num_threads(1)
    tok = load_tokenizer(hf_dir)
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, device="cpu"))
    mt = MultiTurn(EnvConfig(name="calculator"), EVAL["max_turns"], EVAL["max_trajectory_tokens"], tok)
    cfg = DataConfig(sources=[SourceConfig(path=os.path.join(DATA, "val.jsonl"))], max_prompt_len=128)
    examples = PromptDataset.load(cfg, tok, log=None, tools=mt.tools).examples[0][:problems]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    samples = mt.generate(
        engine,
        examples,
        SamplingParams(
            temperature=EVAL["temperature"],
            n=1,
            seed=EVAL["seed"],
            max_new_tokens=EVAL["max_new_tokens"],
            stop_token_ids=[end],
        ),
    )
    n = len(samples)
    return {
        "pass@1_with_tools": round(sum(s.trajectory.reward for s in samples) / n, 4),
        "tool_call_rate": round(sum(s.trajectory.tool_calls > 0 for s in samples) / n, 4),
        "tool_errors_per_trajectory": round(sum(s.trajectory.tool_errors for s in samples) / n, 4),
        "problems": n,
    }


def build_role(work: str, role: str) -> dict:
    """agentic_teacher (from the tiny teacher, AGENTIC) or agentic_student (from the tiny student, STUDENT):
    megaopd SFT on the tool-use traces; records the run in models/agentic_manifest.json under `role`."""
    from build_tiny_models import dir_hashes, sft

    t0 = time.time()
    base, spec = ("teacher", AGENTIC) if role == "agentic_teacher" else ("student", STUDENT)
    src = os.path.join(MODELS, base)
    run = os.path.join(work, f"{role}_sft")
    log(f"{role}: megaopd SFT of {src} on {spec['steps']} x {spec['prompts_per_step']} tool-use traces")
    curve = sft(
        spec,
        src,
        run,
        spec["steps"],
        extra=[f"data.sources=[{{path: {os.path.join(DATA, 'sft.jsonl')}}}]", "validation.path=''"],
    )
    dst = os.path.join(MODELS, role)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    shutil.copytree(os.path.join(run, "hf"), dst)
    path = os.path.join(MODELS, "agentic_manifest.json")
    manifest = json.load(open(path)) if os.path.isfile(path) else {}
    manifest.setdefault("eval", EVAL)
    manifest[role] = {
        "from": f"examples/tiny/models/{base}",
        "sft": spec,
        "sft_nll": curve,
        "with_tools": evaluate_with_tools(dst),
        f"{base}_before_with_tools": evaluate_with_tools(src),
        "files": dir_hashes(dst),
        "build_seconds": round(time.time() - t0),
    }
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    log(f"{role} done in {time.time() - t0:.0f}s: {manifest[role]['with_tools']}")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--teacher", action="store_true")
    ap.add_argument("--student", action="store_true")
    ap.add_argument("--eval", default=None, metavar="HF_DIR")
    args = ap.parse_args(argv)
    if args.data:
        if args.check:
            return check_data()
        write_data(DATA)
        log(f"wrote {DATA}")
    for role, wanted in (("agentic_teacher", args.teacher), ("agentic_student", args.student)):
        if wanted:
            with tempfile.TemporaryDirectory(prefix="tiny_agentic_") as work:
                build_role(work, role)
    if args.eval:
        print(json.dumps(evaluate_with_tools(args.eval)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
