"""Real-sized byte-level BPE tokenizers made from nothing, for start-up costs that grow with the vocabulary
(issue 53: a 262,144-id teacher with 6,384 added tokens, 6,249 of them special, never finished starting).

    student_dir, teacher_dir = make_big_pair(tmp_dir)        # ~49k and 262,144 ids, saved as HF folders

Each vocabulary is GPT-2's 256 byte symbols grown by random merges of two tokens already in it (every merge's
result is a token, so the BPE model is valid and encodes any text), then the added tokens: a few named like chat
markup and thousands of reserved ones, special or not. The two pairs' merges come from different seeds: they
tokenize text differently (a cross-tokenizer pair). Deterministic; a few seconds to build.
"""

from __future__ import annotations

import os
import random

TEACHER_VOCAB = 262_144
TEACHER_ADDED = 6_384
TEACHER_SPECIAL = 6_249
STUDENT_VOCAB = 49_152
STUDENT_ADDED = 17
STUDENT_SPECIAL = 12


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def build_tokenizer(out_dir: str, vocab_size: int, n_added: int, n_special: int, seed: int):
    """A PreTrainedTokenizerFast of `vocab_size` ids (the last `n_added` added tokens, the first `n_special` of
    them special), saved to out_dir; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(alphabet)}
    tokens = list(alphabet)
    merges = []
    common = [c for c in alphabet if c.isalpha() and c.isascii()] + ["Ġ"]  # letters and the space symbol
    n_base = vocab_size - n_added
    while len(tokens) < n_base:
        # mostly short pieces of letters, as a real vocabulary's words and word pieces
        a = rng.choice(common) if rng.random() < 0.5 else tokens[int(len(tokens) * rng.random() ** 3)]
        b = rng.choice(common) if rng.random() < 0.5 else tokens[int(len(tokens) * rng.random() ** 3)]
        if "Ġ" in b or len(a) + len(b) > 16:
            continue
        new = a + b
        if new in vocab:
            continue
        vocab[new] = len(tokens)
        tokens.append(new)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    special = names + [f"<|reserved_special_{i}|>" for i in range(n_special - len(names))]
    plain = [f"<|added_{i}|>" for i in range(n_added - n_special)]
    fast.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": special})
    fast.add_tokens(plain)
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def make_big_pair(root: str) -> tuple[str, str]:
    """(student folder, teacher folder) under root, built once (kept across calls)."""
    student, teacher = os.path.join(root, "student_49k"), os.path.join(root, "teacher_262k")
    if not os.path.isfile(os.path.join(student, "tokenizer.json")):
        build_tokenizer(student, STUDENT_VOCAB, STUDENT_ADDED, STUDENT_SPECIAL, seed=1)
    if not os.path.isfile(os.path.join(teacher, "tokenizer.json")):
        build_tokenizer(teacher, TEACHER_VOCAB, TEACHER_ADDED, TEACHER_SPECIAL, seed=2)
    return student, teacher
