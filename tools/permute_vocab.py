"""The same model on the same tokens in another id order: the control of cross-tokenizer OPD.

    python tools/permute_vocab.py --src MODEL_DIR --out OUT_DIR [--seed 0]

Writes an HF folder whose tokenizer has exactly the tokens of MODEL_DIR's (same merges, same special and
added tokens, same chat template) under other ids (a seeded random permutation of all of them, special ids
included), and whose embedding and output rows are permuted the same way (row perm[i] of the new model is
row i of the old), with config.json's and generation_config.json's bos / eos / pad ids mapped. So the new
model gives every text exactly the old model's log-probs, but no id means what it meant: as a teacher with
`teacher.tokenizer: own` it takes the cross-tokenizer path (re-tokenize, align by characters, span
rewards) with every span one token, and a run with it must match the same-tokenizer run with the original
teacher to float round-off (examples/tiny/README.md, "The permuted-vocabulary control"; docs/algorithms.md
1.13). Only what a BPE tokenizer.json and an unsharded model.safetensors hold is handled (the tiny models).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def permutation(n: int, seed: int) -> list[int]:
    """perm[old_id] = new_id: a seeded random permutation of range(n)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(n, generator=g)]


def permute_tokenizer_json(tok: dict, perm: list[int]) -> dict:
    """tokenizer.json (a BPE model) with every id i renamed perm[i]: the vocabulary's and the added tokens'.
    Merges are strings and stay; the post-processor's special tokens name ids, mapped too. An added token
    that is not in the model's vocabulary (the tiny tokenizer's <think>) is put there under its new id: the
    tokenizers library numbers such tokens after the vocabulary, whatever id the file gives them."""
    if tok["model"].get("type") != "BPE":
        raise ValueError(f"tokenizer.json's model is {tok['model'].get('type')!r}: only BPE is handled")
    out = json.loads(json.dumps(tok))
    out["model"]["vocab"] = {t: perm[i] for t, i in tok["model"]["vocab"].items()}
    for added in out["added_tokens"]:
        added["id"] = perm[added["id"]]
        out["model"]["vocab"].setdefault(added["content"], added["id"])
    for special in (out.get("post_processor") or {}).get("special_tokens", {}).values():
        special["ids"] = [perm[i] for i in special["ids"]]
    return out


def _map_ids(value, perm: list[int]):
    if isinstance(value, list):
        return [perm[v] for v in value]
    return None if value is None else perm[value]


def permute_model(src_dir: str, out_dir: str, seed: int = 0) -> list[int]:
    """Writes the permuted model (module docstring) to out_dir. Returns perm (perm[old_id] = new_id)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_path = os.path.join(src_dir, "model.safetensors")
    for need in (weights_path, os.path.join(src_dir, "tokenizer.json"), os.path.join(src_dir, "config.json")):
        if not os.path.isfile(need):
            raise ValueError(f"{need} is missing: permute_vocab handles an unsharded HF folder with a tokenizer.json")
    with open(os.path.join(src_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    n = int(config["vocab_size"])
    n_tok = max([*tok["model"]["vocab"].values(), *(a["id"] for a in tok["added_tokens"])]) + 1
    if n_tok != n:  # a padded vocabulary's unused rows would need ids of their own: not the tiny models'
        raise ValueError(f"{src_dir}: the tokenizer has {n_tok} ids and config.json vocab_size {n}; they must agree")
    perm = permutation(n, seed)
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(perm)] = torch.arange(n)  # new row j is old row inverse[j]
    weights = load_file(weights_path)
    for key in VOCAB_KEYS:
        if key in weights:
            weights[key] = weights[key][inverse].contiguous()
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src) and not name.startswith(".") and name not in ("model.safetensors", "tokenizer.json"):
            shutil.copy(src, out_dir)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(permute_tokenizer_json(tok, perm), f, ensure_ascii=False, indent=2)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            for key in ID_KEYS:
                if key in data:
                    data[key] = _map_ids(data[key], perm)
            with open(path, "w") as f:
                json.dump(data, f, indent=2)
    return perm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="permute_vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="the model's HF folder")
    ap.add_argument("--out", required=True, help="the HF folder to write")
    ap.add_argument("--seed", type=int, default=0, help="the permutation's seed")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.src):
        print(f"permute_vocab: error: --src {a.src} is not a folder", file=sys.stderr)
        return 2
    try:
        perm = permute_model(a.src, a.out, a.seed)
    except ValueError as e:
        print(f"permute_vocab: error: {e}", file=sys.stderr)
        return 2
    moved = sum(i != p for i, p in enumerate(perm))
    print(f"[permute_vocab] {a.out}: {moved} of {len(perm)} ids moved", file=sys.stderr)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
