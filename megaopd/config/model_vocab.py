"""The start-up check that every model the loss reads has a row for every id the student can emit, read from
the folders' config.json and tokenizer files before any model loads (no torch, no transformers).

    check_model_vocab(cfg, needs)        # raises ValueError naming the model, its vocab_size and the fix

Why: the loss gathers the teacher's (and the reference's) log-probs at the ids the student samples. A teacher
whose embedding has fewer rows than the student's tokenizer has ids passes the tokenizer comparison (the
regular vocabularies agree) and then reads past its vocabulary: the loss reached 1.6e29 and the gradient norm 1e308,
and nothing stopped.
Embedding sizes may still differ within a family (Qwen2.5-Math-1.5B 151936 vs 7B 152064): what is required
is coverage, and for gkd, whose loss reads the teacher's whole logits in the student's sharding, the same
padded width.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from megaopd.models.config import read_config_json
from megaopd.models.hf_config import padded_vocab_size


def tokenizer_id_count(path: str) -> int | None:
    """1 + the largest id the tokenizer of an HF directory (or of a megaopd checkpoint, in hf/) can emit, from
    tokenizer.json's vocabulary and added tokens and tokenizer_config.json's added_tokens_decoder; None when
    the folder has neither file (a tokenizer of another format: the trainer's own comparison still runs)."""
    ids: list[int] = []
    for folder in (path, os.path.join(path, "hf")):
        tok_json, tok_cfg = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tok_json):
            with open(tok_json) as f:
                raw = json.load(f)
            vocab = (raw.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                ids += [int(i) for i in vocab.values()]
            elif isinstance(vocab, list):  # unigram models: [[piece, score], ...], ids by position
                ids.append(len(vocab) - 1)
            ids += [int(t["id"]) for t in raw.get("added_tokens") or [] if "id" in t]
        if os.path.isfile(tok_cfg):
            with open(tok_cfg) as f:
                ids += [int(i) for i in (json.load(f).get("added_tokens_decoder") or {})]
        if ids:
            return max(ids) + 1
    return None


def _vocab_size(path: str) -> int | None:
    try:
        value = read_config_json(path).get("vocab_size")  # ValueError naming the file when it is not JSON
    except FileNotFoundError:
        return None
    return int(value) if value is not None else None


def cross_tokenizer_teachers(cfg) -> list[str]:
    """The teachers with teacher.tokenizer=own whose tokenizer maps text to other ids than the student's
    (megaopd.data.vocab.compare_vocab): the cross-tokenizer ones. The others share the student's ids."""
    from megaopd.data.vocab import VocabMismatchError, compare_vocab
    from megaopd.models.hf_io import load_tokenizer

    own = [t for t in cfg.teachers if t.tokenizer == "own" and t.path]
    if not own:
        return []
    student = load_tokenizer(cfg.student.path)
    out = []
    for t in own:
        try:
            compare_vocab(student, load_tokenizer(t.path), cfg.student.path, t.path)
        except VocabMismatchError:
            out.append(t.name)
    return out


def check_model_vocab(cfg, needs, cross: Sequence[str] = ()) -> None:
    """Every model the job reads (student, reference, each teacher with a config.json) has embedding rows for
    every id of the student's tokenizer; gkd's teacher has the student's padded vocabulary width. cross: the
    teachers of another vocabulary, which read their own ids only."""
    student = cfg.student.path
    ids = tokenizer_id_count(student)
    student_vocab = _vocab_size(student)
    roles = [("student", student), ("reference", cfg.reference.path)]
    roles += [
        ("teacher" if len(cfg.teachers) == 1 else f"teachers[{i}] ({t.name})", t.path)
        for i, t in enumerate(cfg.teachers)
        if needs.teacher and t.name not in cross
    ]
    for role, path in roles:
        vocab = _vocab_size(path) if path else None
        if ids is None or vocab is None or vocab >= ids:
            continue
        raise ValueError(
            f"{role} {path} has vocab_size={vocab} (config.json) but the student's tokenizer ({student}) emits ids "
            f"up to {ids - 1}: the loss reads the {role}'s log-probs at every id the student samples, so its "
            f"embedding needs a row for each; use a {role} of the student's vocabulary (vocab_size >= {ids})"
        )
    if needs.teacher_logits and student_vocab is not None:
        t = cfg.teachers[0]
        tv = _vocab_size(t.path)
        tp = cfg.student.tp
        if tv is not None and padded_vocab_size(tv, tp) != padded_vocab_size(student_vocab, tp):
            raise ValueError(
                f"gkd reads the teacher's whole logits in the student's vocabulary sharding, but teacher {t.path} "
                f"has vocab_size={tv} (padded {padded_vocab_size(tv, tp)} at tp={tp}) and student {student} "
                f"vocab_size={student_vocab} (padded {padded_vocab_size(student_vocab, tp)}): use a teacher with "
                f"the student's vocab_size, or a loss that reads the teacher at the sampled ids (opd, lsm)"
            )
