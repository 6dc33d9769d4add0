"""Golden NLL: the mean negative log-likelihood per token of the validation set's golden solutions under a model.

    python examples/real/golden_nll.py MODEL_DIR [MODEL_DIR ...] [--data examples/real/data/val.jsonl]

MODEL_DIR: an HF folder (the cached SmolLM2 models, or a run's final student `RUN/hf`). Each golden is scored
exactly as the SFT term of the loss sees it (megaopd.data.build_examples: the problem in the student's chat
template with the default instruction, then the solution tokens and <|im_end|>), by transformers in float32;
the NLL is averaged over every solution token of every problem (the prompt is context, not scored). Prints
one line per model: `MODEL_DIR  nll N.NNNN  tokens T`; --json writes them too.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from megaopd.data.config import DataConfig
from megaopd.data.openr1 import GoldenRecord
from megaopd.data.tokenize import build_examples

HERE = os.path.dirname(os.path.abspath(__file__))


def golden_nll(model_dir: str, rows: list[dict]) -> tuple[float, int]:
    """(mean NLL per solution token, solution tokens) of rows' goldens under the model in model_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = [GoldenRecord(uuid=r["uuid"], problem=r["problem"], answer=r["answer"], golden=r["golden"]) for r in rows]
    # the training data's limits are far above these goldens; nothing is skipped (checked below)
    examples, skipped, _ = build_examples(records, "val", DataConfig(max_prompt_len=1024, max_golden_len=1024), tok)
    if skipped:
        raise ValueError(f"{model_dir}: skipped {dict(skipped)}")
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.golden_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)  # [T-1, V]: predicts ids[1:]
            token_lp = logprobs.gather(-1, ids[0, 1:, None])[:, 0]  # [T-1]
            mask = torch.tensor(ex.golden_loss_mask[1:], dtype=torch.bool)
            total -= token_lp[mask].sum().item()
            count += int(mask.sum())
    return total / count, count


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="HF model folders")
    p.add_argument("--data", default=os.path.join(HERE, "data", "val.jsonl"))
    p.add_argument("--json", help="also write {model_dir: {nll, tokens}} here")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    results = {}
    for model_dir in args.models:
        nll, tokens = golden_nll(os.path.expanduser(model_dir), rows)
        assert math.isfinite(nll), (model_dir, nll)
        results[model_dir] = {"nll": nll, "tokens": tokens}
        print(f"{model_dir}  nll {nll:.4f}  tokens {tokens}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
