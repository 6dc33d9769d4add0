"""Cross-tokenizer alignment (megaopd.data.alignment) against a float64 single-process reference written from
its docstring with plain loops over characters: offsets, spans (a span ends where both tokenizations have a
boundary), and the teacher's span log-probs spread over the student's tokens. Hand-made tokenizations that
disagree everywhere, Unicode (multi-byte characters, emoji, CJK), whitespace runs and special tokens; then
random texts through real HF fast tokenizers: the tiny tokenizer, the tiny teacher's other tokenizer
(examples/tiny/tokenizer_xtok) and SmolLM2's byte-level BPE (when its folder is cached).

    pytest tests/data/test_alignment.py
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from megaopd.data.alignment import (
    CharSpan,
    SpanAlignment,
    _decode_incremental,
    align_by_chars,
    decode_with_offsets,
    retokenize,
    special_ids,
    spread_span_logprobs,
    token_offsets,
)
from tests.data.conftest import ROOT, TINY_TOKENIZER

XTOK_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer_xtok")
SMOLLM2 = os.path.expanduser("~/.cache/megaopd/models/SmolLM2-135M-Instruct")
QWEN2 = os.path.expanduser("~/.cache/megaopd/models/SmolLM2-135M-Instruct-qwen2-vocab")
"""Qwen2's real tokenizer (tools/fetch_smollm2.py --qwen2-teacher), when cached."""


# ------------------------------------------------------------------------------------------------ reference
def reference_spans(s_offsets, t_offsets) -> tuple[list[int], list[int], int]:
    """Literal: mark every character boundary each side has; a span ends at a boundary of both; a token
    belongs to the span of its first character (an empty one: the character at its place; specials and
    positions past the text: none)."""
    length = max([e for s, e in s_offsets if e > s] or [0])
    s_ends = [False] * (length + 1)
    t_ends = [False] * (length + 1)
    for offsets, marks in ((s_offsets, s_ends), (t_offsets, t_ends)):
        for off in offsets:
            if off[1] > off[0] and not getattr(off, "special", False):
                marks[off[1]] = True
    span_of_char, span = [], 0
    for c in range(length):
        span_of_char.append(span)
        if s_ends[c + 1] and t_ends[c + 1]:
            span += 1

    def of(offsets):
        return [-1 if getattr(off, "special", False) or off[0] >= length else span_of_char[off[0]] for off in offsets]

    return of(s_offsets), of(t_offsets), span


def reference_spread(teacher_lp: list[float], alignment: SpanAlignment) -> list[float]:
    out = []
    for s in alignment.student_span:
        if s < 0:
            out.append(0.0)
            continue
        total = sum(lp for lp, t in zip(teacher_lp, alignment.teacher_span) if t == s)
        out.append(total / alignment.student_span.count(s))
    return out


def pieces_offsets(pieces: list[str], specials: set[int] = frozenset()) -> list[CharSpan]:
    """Offsets of hand-made tokens given as their texts (indices in `specials`: special tokens, no text)."""
    out, n = [], 0
    for i, p in enumerate(pieces):
        if i in specials:
            out.append(CharSpan(n, n, special=True))
            continue
        out.append(CharSpan(n, n + len(p)))
        n += len(p)
    return out


def check_alignment(text: str, s_off, t_off, teacher_lp=None) -> SpanAlignment:
    """align_by_chars equals the reference; every span's student text equals its teacher text; the spread
    log-probs equal the reference's and sum to the teacher's span sums (float64)."""
    al = align_by_chars(s_off, t_off)
    ref_s, ref_t, n = reference_spans(s_off, t_off)
    assert (al.student_span, al.teacher_span, al.n_spans) == (ref_s, ref_t, n)
    for side, offsets, spans in (("student", s_off, al.student_span), ("teacher", t_off, al.teacher_span)):
        got = [""] * al.n_spans
        for (s, e), sp in zip(offsets, spans):
            if sp >= 0:
                got[sp] += text[s:e]
        assert "".join(got) == text, side
        if side == "student":
            s_text = got
        else:
            assert got == s_text  # the two sides cover every span with the same characters
    g = torch.Generator().manual_seed(len(text))
    lp = teacher_lp if teacher_lp is not None else -torch.rand(len(t_off), generator=g, dtype=torch.float64) * 5
    values, spans = spread_span_logprobs(lp, al)
    assert values.dtype == torch.float64 and spans.dtype == torch.long
    assert spans.tolist() == al.student_span
    torch.testing.assert_close(values, torch.tensor(reference_spread(lp.tolist(), al), dtype=torch.float64))
    for sp in range(al.n_spans):
        teacher_sum = sum(float(x) for x, t in zip(lp, al.teacher_span) if t == sp)
        assert abs(float(values[spans == sp].sum()) - teacher_sum) < 1e-12
    return al


# ------------------------------------------------------------------------------------------------ hand-made
def test_tokenizations_that_disagree_everywhere_merge_to_common_boundaries():
    text = "abcdefghijkl"
    s = pieces_offsets([text[i : i + 2] for i in range(0, 12, 2)])  # ab|cd|ef|...
    t = pieces_offsets([text[i : i + 3] for i in range(0, 12, 3)])  # abc|def|...
    al = check_alignment(text, s, t)
    assert al.n_spans == 2 and al.student_span == [0, 0, 0, 1, 1, 1] and al.teacher_span == [0, 0, 1, 1]
    # Offset by one everywhere: the only common boundary is the end, one span.
    t = pieces_offsets(["a"] + [text[i : i + 2] for i in range(1, 11, 2)] + ["l"])
    assert check_alignment(text, s, t).n_spans == 1


def test_identical_tokenizations_give_one_span_per_token_and_the_teacher_values_unchanged():
    text = "Add 8 to both sides"
    off = pieces_offsets(["Add", " 8", " to", " both", " sides"])
    lp = torch.tensor([-0.5, -1.0, -0.25, -2.0, -0.125], dtype=torch.float64)
    al = check_alignment(text, off, off, lp)
    assert al.student_span == al.teacher_span == [0, 1, 2, 3, 4]
    assert torch.equal(spread_span_logprobs(lp, al)[0], lp)


def test_the_example_of_the_docstring():
    text = "Hello world"
    al = check_alignment(text, pieces_offsets(["Hel", "lo", " wor", "ld"]), pieces_offsets(["Hello", " w", "orld"]))
    assert (al.student_span, al.teacher_span) == ([0, 0, 1, 1], [0, 1, 1])


def test_special_tokens_never_align_and_get_zero():
    text = "x = 3"
    s = pieces_offsets(["x", "<|im_start|>", " = ", "3", "<|im_end|>"], specials={1, 4})
    t = pieces_offsets(["x", " = 3"])
    al = check_alignment(text, s, t)
    assert al.student_span == [0, -1, 1, 1, -1]
    values, _ = spread_span_logprobs(torch.tensor([-1.0, -2.0], dtype=torch.float64), al)
    assert values.tolist() == [-1.0, 0.0, -1.0, -1.0, 0.0]


def test_whitespace_runs_and_newlines():
    text = "a  \n\n\t b   c\n"
    s = pieces_offsets(["a", "  ", "\n\n", "\t b", "   ", "c\n"])
    t = pieces_offsets(["a ", " \n", "\n\t", " b ", "  c", "\n"])
    check_alignment(text, s, t)


def test_empty_partial_character_tokens_join_the_span_of_the_character():
    # An emoji in two byte-level tokens: the first holds no complete character (empty at its place).
    text = "a😀b"
    s = [CharSpan(0, 1), CharSpan(1, 1), CharSpan(1, 2), CharSpan(2, 3)]
    t = pieces_offsets(["a", "😀b"])
    al = check_alignment(text, s, t)
    assert al.student_span == [0, 1, 1, 1]
    # Bytes after the last complete character (a response cut inside an emoji): no span.
    al = check_alignment("ab", [CharSpan(0, 2), CharSpan(2, 2)], pieces_offsets(["a", "b"]))
    assert al.student_span == [0, -1]


def test_an_empty_side_aligns_nothing():
    """An empty response (only the stop token), or text the teacher's tokenizer drops: no span, no error."""
    al = align_by_chars([CharSpan(0, 0, special=True)], [])
    assert (al.student_span, al.teacher_span, al.n_spans) == ([-1], [], 0)
    values, spans = spread_span_logprobs(torch.zeros(0, dtype=torch.float64), al)
    assert values.tolist() == [0.0] and spans.tolist() == [-1]
    assert align_by_chars(pieces_offsets(["  "]), []).student_span == [-1]


def test_different_text_lengths_are_one_clear_error():
    with pytest.raises(ValueError, match="partition the same text"):
        align_by_chars(pieces_offsets(["ab", "c"]), pieces_offsets(["ab"]))


def test_spread_checks_the_number_of_teacher_values():
    al = align_by_chars(pieces_offsets(["ab"]), pieces_offsets(["a", "b"]))
    with pytest.raises(ValueError, match="2 teacher tokens"):
        spread_span_logprobs(torch.zeros(3), al)


def test_charspan_pickles_with_its_mark():
    import pickle

    span = pickle.loads(pickle.dumps(CharSpan(3, 3, special=True)))
    assert span == (3, 3) and span.special


# ------------------------------------------------------------------------------------------------ real tokenizers
def _tokenizers() -> dict:
    from megaopd.models.hf_io import load_tokenizer

    toks = {"tiny": load_tokenizer(TINY_TOKENIZER), "tiny_xtok": load_tokenizer(XTOK_TOKENIZER)}
    if os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")):
        toks["smollm2"] = load_tokenizer(SMOLLM2)
    if os.path.isfile(os.path.join(QWEN2, "tokenizer.json")):
        toks["qwen2"] = load_tokenizer(QWEN2)
    return toks


@pytest.fixture(scope="module")
def tokenizers():
    return _tokenizers()


POOL = (
    list("abcxyzABC0123456789+-*/=().,:;!?\\{}$_^")
    + [" ", "  ", "   ", "\n", "\n\n", "\t", " \n "]
    + ["é", "ü", "ß", "—", "π", "≈", "∑", "数", "学", "题", "😀", "🚀", "👍🏽", "✓"]
    + ["Divide both sides by ", "The answer is \\boxed{", "x = ", "<think>\n", "</think>", "<|im_end|>"]
)


def random_text(rng: random.Random, ascii_only: bool) -> str:
    pool = [p for p in POOL if p.isascii()] if ascii_only else POOL
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 40)))


def _student_text_and_offsets(tok, text: str):
    ids = tok.encode(text, add_special_tokens=False)
    return ids, decode_with_offsets(tok, ids)


@pytest.mark.parametrize(
    "student,teacher",
    [
        ("tiny", "tiny_xtok"),
        ("tiny_xtok", "tiny"),
        ("smollm2", "tiny_xtok"),
        ("tiny", "smollm2"),
        ("smollm2", "smollm2"),
        ("smollm2", "qwen2"),
        ("qwen2", "smollm2"),
    ],
)
def test_random_texts_through_real_tokenizers(tokenizers, student, teacher):
    """Property check over random texts: the student's offsets partition its response text (which decodes
    back to the same ids' text), the teacher's re-tokenization covers the same text, and every span has the
    same characters on both sides with exact span sums (check_alignment)."""
    if student not in tokenizers or teacher not in tokenizers:
        pytest.skip(f"{SMOLLM2} or {QWEN2} is not cached")
    s_tok, t_tok = tokenizers[student], tokenizers[teacher]
    rng = random.Random(f"{student}-{teacher}")
    merged = 0
    for _ in range(60):
        # The tiny tokenizers know printable ASCII only (other characters read <|unk|>, whose decode is empty).
        ascii_only = student.startswith("tiny")
        text = random_text(rng, ascii_only)
        ids, (response, s_off) = _student_text_and_offsets(s_tok, text)
        assert len(s_off) == len(ids)
        assert [o[0] for o in s_off[1:]] == [o[1] for o in s_off[:-1]]  # a partition, in order
        assert "".join(response[s:e] for s, e in s_off) == response
        assert (response, s_off) == _decode_incremental(s_tok, ids, special_ids(s_tok))  # the fast path agrees
        regular = [i for i in ids if i not in special_ids(s_tok)]  # <|unk|> is text (it stands for some)
        assert response == s_tok.decode(regular, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        t_ids, t_off = retokenize(response, t_tok)
        assert [o[0] for o in t_off[1:]] == [o[1] for o in t_off[:-1]] and (not t_off or t_off[0][0] == 0)
        if not response:
            continue
        assert t_off[-1][1] == len(response)
        al = check_alignment(response, s_off, t_off)
        merged += len(ids) - al.n_spans
    if student != teacher:
        assert merged > 0  # the tokenizations do disagree


def test_byte_level_partial_characters_and_specials(tokenizers):
    if "smollm2" not in tokenizers:
        pytest.skip(f"{SMOLLM2} is not cached")
    tok = tokenizers["smollm2"]
    text = "Hi  there 😀 数学 é\n\n  x"
    ids = [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode(text, add_special_tokens=False)
    ids += [tok.eos_token_id]
    response, offsets = decode_with_offsets(tok, ids)
    assert response == text
    assert offsets[0] == (0, 0) and offsets[0].special and offsets[-1].special
    pieces = tok.convert_ids_to_tokens(ids)
    empty = [p for p, o in zip(pieces, offsets) if o[0] == o[1] and not o.special]
    assert empty, "the emoji and the CJK characters take more than one byte-level token"
    assert token_offsets(tok, ids) == offsets
    # Against the tiny tokenizer (ASCII only: the emoji and CJK read <|unk|>, which aligns like a token).
    t_ids, t_off = retokenize(response, tokenizers["tiny"])
    al = align_by_chars(offsets, t_off)
    assert al.student_span[0] == al.student_span[-1] == -1
    assert min(al.student_span[1:-1]) >= 0 and min(al.teacher_span) >= 0


def test_tiny_and_xtok_tokenize_the_same_text_differently(tokenizers):
    a, b = tokenizers["tiny"], tokenizers["tiny_xtok"]
    text = "<think>\nAdd 8 to both sides: 8x = 96\n</think>\nThe answer is \\boxed{12}."
    ia, ib = a.encode(text, add_special_tokens=False), b.encode(text, add_special_tokens=False)
    assert a.decode(ia) == b.decode(ib) == text
    assert len(ia) != len(ib) and a.convert_tokens_to_ids("a") != b.convert_tokens_to_ids("a")
    assert (len(a), len(b)) == (256, 384)
    assert (b.eos_token, b.eos_token_id, b.pad_token_id) == (a.eos_token, a.eos_token_id, a.pad_token_id)


def test_alignment_report_says_which_mode_and_why(tokenizers):
    from megaopd.data.alignment import alignment_report

    lines = alignment_report(tokenizers["tiny"], tokenizers["tiny_xtok"])
    assert len(lines) == 2 and "another tokenizer (256 student ids, 384 teacher ids" in lines[0]
    assert "spans" in lines[1] and "gkd and lsm are refused" in lines[1]


@pytest.mark.slow
def test_a_real_sized_cross_tokenizer_pair_starts_in_seconds(tmp_path_factory):
    """Issue 53: a 262,144-id teacher with 6,384 added tokens (6,249 special) against a 49k student ran 23
    minutes in alignment_report (special_ids walked the added tokens once per vocabulary id) and never started.
    The whole start-up check (the vocabulary compare that finds them different, then the report) must take
    seconds: under 30 s of the process's CPU time (wall time on a shared machine moves with its load;
    benchmarks/README.md has both)."""
    import time
    from types import SimpleNamespace

    from megaopd.models.hf_io import load_tokenizer
    from megaopd.trainer.roles import check_teacher_tokenizers
    from tests.data.big_tokenizers import TEACHER_ADDED, TEACHER_SPECIAL, TEACHER_VOCAB, make_big_pair

    student_dir, teacher_dir = make_big_pair(str(tmp_path_factory.mktemp("big_tokenizers")))
    student, teacher = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    assert len(teacher) == TEACHER_VOCAB and len(teacher.added_tokens_decoder) == TEACHER_ADDED
    assert len(special_ids(teacher)) == TEACHER_SPECIAL
    lines, cross = [], set()
    cpu, wall = time.process_time(), time.perf_counter()
    teacher_cfg = SimpleNamespace(name="teacher", path=teacher_dir, tokenizer="own")
    check_teacher_tokenizers(student, student_dir, [teacher_cfg], [teacher], (), lines.append, cross)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert cross == {"teacher"}
    assert any("262144 teacher ids" in line for line in lines), lines
    assert cpu < 30, f"start-up check took {cpu:.1f} s of CPU ({wall:.1f} s wall)"
