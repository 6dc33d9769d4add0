"""Put a causal LM onto another tokenizer: a teacher of another vocabulary made from a model of this one.

    python tools/transplant_vocab.py --src MODEL_DIR --tokenizer TOKENIZER_DIR --out OUT_DIR

Every weight but the vocabulary's is copied. The embedding of each new token is the mean of the source
embeddings of its text's source tokens (a special or added token: the source token of the same text, when
there is one); its output row is the source output row of its text's FIRST source token, so its logit tracks
how likely the next text starts as it does. A model with tied embeddings stays tied (its output rows are then
the mean embeddings). The result is an ordinary HF folder with the new tokenizer's files: a teacher for
`teacher.tokenizer: own` (docs/algorithms.md 1.13) whose scores mean something before any training, used by
tools/build_tiny_models.py (examples/tiny/models/teacher_xtok's start) and tools/fetch_smollm2.py (the
real-model tier's teacher with Qwen2's tokenizer).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def source_ids(old_tok, new_tok) -> list[list[int]]:
    """For each new id, the source ids it is made from (never empty: a text the source cannot spell, such as a
    lone byte of a multi-byte character, takes the source's unknown or end-of-text token)."""
    named = {t.content: i for i, t in old_tok.added_tokens_decoder.items()}
    texts, out = [], []
    for new_id in range(len(new_tok)):
        added = new_tok.added_tokens_decoder.get(new_id)
        texts.append(None if added is not None and added.content in named else new_tok.decode([new_id]))
    encoded = old_tok([t for t in texts if t is not None], add_special_tokens=False)["input_ids"]
    fallback = [old_tok.unk_token_id if old_tok.unk_token_id is not None else old_tok.eos_token_id]
    it = iter(encoded)
    for new_id, text in enumerate(texts):
        if text is None:
            out.append([named[new_tok.added_tokens_decoder[new_id].content]])
        else:
            out.append(next(it) or fallback)
    return out


def transplant(src_dir: str, tokenizer_dir: str, out_dir: str) -> int:
    """Writes the source model on the new tokenizer to out_dir (module docstring). Returns #parameters."""
    import torch
    import transformers

    from megaopd.models.hf_io import load_tokenizer

    old_tok, new_tok = load_tokenizer(src_dir), load_tokenizer(tokenizer_dir)
    src = transformers.AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    config = src.config.__class__.from_dict(src.config.to_dict())
    config.vocab_size = len(new_tok)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(new_tok, key) is not None:  # else the source's (the same special tokens, or unused)
            setattr(config, key, getattr(new_tok, key))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    vocab_keys = {"model.embed_tokens.weight", "lm_head.weight"}
    state = {k: v for k, v in src.state_dict().items() if k not in vocab_keys}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not set(missing) <= vocab_keys or unexpected:
        raise ValueError(f"{src_dir}: weights outside the vocabulary's differ: missing {missing}, extra {unexpected}")
    old_emb, old_head = src.get_input_embeddings().weight.detach(), src.lm_head.weight.detach()
    emb, head = model.get_input_embeddings().weight, model.lm_head.weight
    tied = emb.data_ptr() == head.data_ptr()
    with torch.no_grad():
        for new_id, old_ids in enumerate(source_ids(old_tok, new_tok)):
            emb[new_id] = old_emb[old_ids].mean(0)
            if not tied:
                head[new_id] = old_head[old_ids[0]]
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    for f in sorted(os.listdir(tokenizer_dir)):
        if os.path.isfile(os.path.join(tokenizer_dir, f)) and not f.startswith("."):
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="transplant_vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="the source model's HF folder")
    ap.add_argument("--tokenizer", required=True, help="a folder with the new tokenizer's files")
    ap.add_argument("--out", required=True, help="the HF folder to write")
    a = ap.parse_args(argv)
    for key, path in (("--src", a.src), ("--tokenizer", a.tokenizer)):
        if not os.path.isdir(path):
            print(f"transplant_vocab: error: {key} {path} is not a folder", file=sys.stderr)
            return 2
    n = transplant(a.src, a.tokenizer, a.out)
    print(f"[transplant_vocab] {a.out}: {n / 1e6:.1f}M parameters", file=sys.stderr)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
