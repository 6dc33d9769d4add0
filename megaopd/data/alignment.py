"""Cross-tokenizer alignment: the student's response tokens and a teacher's tokens of the same text, matched
by characters, and the teacher's log-probs carried over onto the student's tokens (issue 46).

    text, s_offsets = decode_with_offsets(student_tok, response_ids)   # the text and each token's characters
    t_ids, t_offsets = retokenize(text, teacher_tok)                   # the teacher's tokens of that text
    alignment = align_by_chars(s_offsets, t_offsets)                   # spans both tokenizations agree on
    (or the three at once: text, t_ids, alignment = align_response(student_tok, teacher_tok, response_ids))
    ... the teacher scores its prefix + t_ids: log q of each teacher token, teacher_logprobs_T ...
    values_T, spans_T = spread_span_logprobs(teacher_logprobs_T, alignment)   # per student token

Offsets. Each token gets a half-open character range [start, end) of the response text; the ranges of one
tokenization partition the text in order (end of one = start of the next). The text is the regular tokens'
decoded text, with special tokens (the tokenizer's special ids: <|im_end|>, <|endoftext|>, ...) skipped:
chat markup of one side never reaches the other. A special token gets the empty range (start, start) at its
place and is marked (`CharSpan.special`) so that it never aligns. A byte-level BPE token may hold only part of a
multi-byte UTF-8 character (an emoji, a CJK character): such a token gets an empty range and the token that
completes the character holds the character (it is "merged" into its last token; decode_with_offsets also
moves the partial token's earlier complete characters there, retokenize leaves them with it); an empty
regular token belongs to the span of the character at its place, so its log-prob counts with that
character's. Trailing bytes that complete no character (a response cut inside an emoji) have no
span (-1).

Spans (GOLD's merge rule, TRL's GOLD trainer / "Universal Logit Distillation" 2402.12030 follow-up): a span ends
where BOTH tokenizations have a token boundary. Student tokens [Hel][lo][ wor][ld] and teacher tokens [Hello]
[ w][orld] give spans "Hello" (2 student, 1 teacher token) and " world" (2 and 2). Each span is one stretch of
text that both sides cover whole, so the sum of a side's log-probs over a span is that side's log-prob of its
own tokens of the span's text given the same preceding text: the two sums are comparable, token counts aside
(neither sums over the other ways its tokenizer could spell the same text; GOLD does not either).

spread_span_logprobs puts the span's summed teacher log-prob on its student tokens, spread evenly (each gets
sum / n), so that summing the student tokens of a span gives the teacher's span log-prob exactly; the loss
(losses/cross_tokenizer.py, `teacher_spans_BT`) then takes span sums on both sides.

Pure functions of tokenizer objects, ids and tensors; nothing is read from disk.

    pytest tests/data/test_alignment.py
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from dataclasses import dataclass
from typing import Sequence

import torch


class CharSpan(tuple):
    """(start, end) character range of one token, a plain 2-tuple to unpack; `special` marks a special token
    (an empty range that never aligns)."""

    special: bool

    def __new__(cls, start: int, end: int, special: bool = False):
        obj = super().__new__(cls, (int(start), int(end)))
        obj.special = special
        return obj

    def __reduce__(self):  # pickles (spawned workers, served teachers) keep the mark
        return (CharSpan, (self[0], self[1], self.special))

    def __repr__(self) -> str:
        return f"CharSpan({self[0]}, {self[1]}{', special' if self.special else ''})"


def special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special ids: all_special_ids and every added token marked special (chat markup), but
    not the unknown token, which stands for text the vocabulary lacks (the tiny tokenizers' <|unk|> for a
    non-ASCII character) and aligns like any token. Added tokens that are not special (the tiny tokenizer's
    <think>) are text like any other.

    Computed once per tokenizer and size (a real teacher has thousands of added tokens: walking them per
    response, or per vocabulary id, made start-up O(V x added), issue 53); tokens added later make a new entry."""
    key = (id(tokenizer), len(tokenizer))
    cached = _SPECIALS.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    ids.discard(getattr(tokenizer, "unk_token_id", None))
    if len(_SPECIALS) > 16:  # a handful of tokenizers live in a process; the cache keeps them alive
        _SPECIALS.clear()
    _SPECIALS[key] = (tokenizer, frozenset(ids))
    return _SPECIALS[key][1]


_SPECIALS: dict[tuple[int, int], tuple[object, frozenset[int]]] = {}
"""special_ids' results by (id(tokenizer), its length), with the tokenizer itself (kept alive, so an id is
never reused by another object while its entry stands)."""


def _decode(tokenizer, ids: Sequence[int]) -> str:
    """The backend's decode: no special-token skipping here (the caller passes regular ids only) and no
    clean_up_tokenization_spaces (it would move text across token boundaries)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=False)
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decode_with_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[CharSpan]]:
    """(text, offsets): the response text the teacher re-tokenizes and each token's character range in it.

    Incremental detokenization (as streaming servers do it): a token's text is what it adds to the decode of
    the tokens since the last complete character; a token that leaves the decode ending in an incomplete
    UTF-8 character (U+FFFD) adds nothing yet and gets an empty range. Decoders that change a token's text
    by its neighbours (SentencePiece drops a leading space at the start of a decode) are handled by the same
    diff: the window always starts at a token already decoded."""
    specials = special_ids(tokenizer)
    ids = [int(i) for i in ids]
    return _decode_each(tokenizer, ids, specials) or _decode_incremental(tokenizer, ids, specials)


def _decode_incremental(tokenizer, ids: list[int], specials: set[int]) -> tuple[str, list[CharSpan]]:
    """decode_with_offsets token by token (two decodes of a short window per token)."""
    regular: list[int] = []
    offsets: list[CharSpan] = []
    pieces: list[str] = []
    n = 0  # characters so far
    prefix, read = 0, 0  # regular[prefix:read] is the decoded window before the pending tokens
    for token in ids:
        if token in specials:
            offsets.append(CharSpan(n, n, special=True))
            continue
        regular.append(token)
        before = _decode(tokenizer, regular[prefix:read])
        after = _decode(tokenizer, regular[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before) :]
            # The pending tokens (empty so far) and this one: the completed characters go to this token.
            offsets.append(CharSpan(n, n + len(piece)))
            pieces.append(piece)
            n += len(piece)
            prefix, read = read, len(regular)
        else:
            offsets.append(CharSpan(n, n))
    return "".join(pieces), offsets


def _decode_each(tokenizer, ids: list[int], specials: set[int]) -> tuple[str, list[CharSpan]] | None:
    """The fast path of decode_with_offsets (one batched decode, about 1 us a token against 8 for the
    incremental one): each regular token decoded alone. Taken only when every piece is whole text (no
    U+FFFD: no partial UTF-8 character) and the pieces join to the decode of all of them (a decoder that
    changes a token's text by its neighbours, as SentencePiece's leading space, fails this); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    regular = [i for i in ids if i not in specials]
    pieces = backend.decode_batch([[i] for i in regular], skip_special_tokens=False)
    text = "".join(pieces)
    if any("\ufffd" in p for p in pieces) or text != _decode(tokenizer, regular):
        return None
    offsets, n, it = [], 0, iter(pieces)
    for token in ids:
        if token in specials:
            offsets.append(CharSpan(n, n, special=True))
        else:
            piece = next(it)
            offsets.append(CharSpan(n, n + len(piece)))
            n += len(piece)
    return text, offsets


def token_offsets(tokenizer, ids: Sequence[int]) -> list[CharSpan]:
    """Character range of each of the student's response token ids in its response text (the text of
    decode_with_offsets: the regular tokens decoded, special tokens skipped, no space clean-up). Special
    tokens: empty and marked; tokens holding part of a UTF-8 character: empty at the character's start (the
    completing token holds it). See the module docstring."""
    return decode_with_offsets(tokenizer, ids)[1]


def retokenize(text: str, tokenizer) -> tuple[list[int], list[CharSpan]]:
    """The teacher's tokens of the response text (no special tokens added; special-token strings in the text
    are read as text, since markup never crosses sides) and their character ranges: the fast tokenizer's
    offsets, made a partition of the text like decode_with_offsets' (a byte-level token that shares a
    character with the next one gets the empty range at it; leading spaces the offsets trim, and any
    uncovered stretch, go to the token after them; the last token reaches the end of the text)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    ids = [int(i) for i in enc["input_ids"]]
    raw = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
    specials = special_ids(tokenizer)
    offsets = []
    start = 0
    for k, (s, e) in enumerate(raw):
        end = len(text) if k == len(raw) - 1 else min(max(e, s), raw[k + 1][0])
        end = max(end, start)
        offsets.append(CharSpan(start, end, special=ids[k] in specials))
        start = end
    return ids, offsets


@dataclass(frozen=True, kw_only=True)
class SpanAlignment:
    """Two tokenizations of one text grouped into spans that end where both have a token boundary."""

    student_span: list[int]
    """Per student response token: its span index in 0..n_spans-1, or -1 when it has no counterpart (a
    special token; bytes after the last complete character)."""
    teacher_span: list[int]
    """Per teacher token: its span index, or -1 likewise."""
    n_spans: int
    """Spans; each holds >= 1 token of each side."""


def align_by_chars(
    student_offsets: Sequence[tuple[int, int]], teacher_offsets: Sequence[tuple[int, int]]
) -> SpanAlignment:
    """Spans of the text both offset lists partition (decode_with_offsets' and retokenize's): the cuts are
    the positions where both a student token and a teacher token end. A non-empty token lies inside one
    span; an empty regular token belongs to the span of the character at its place (-1 at the end of the
    text); a special token (CharSpan.special) to none. The two lists must cover the same text length (else
    ValueError), except that a side with no text at all aligns nothing (every token -1, no span)."""

    def ends(offsets) -> tuple[set[int], int]:
        cuts = {off[1] for off in offsets if off[1] > off[0] and not getattr(off, "special", False)}
        return cuts, max(cuts, default=0)

    s_cuts, s_len = ends(student_offsets)
    t_cuts, t_len = ends(teacher_offsets)
    if not s_len or not t_len:  # a side with no text (an empty response; whitespace a tokenizer drops)
        return SpanAlignment(
            student_span=[-1] * len(student_offsets), teacher_span=[-1] * len(teacher_offsets), n_spans=0
        )
    if s_len != t_len:
        raise ValueError(
            f"the student's tokens cover {s_len} characters and the teacher's {t_len}: both offset lists must "
            f"partition the same text (decode_with_offsets for the student, retokenize of that text for the teacher)"
        )
    cuts = sorted(s_cuts & t_cuts)  # the last cut is the text's end, a boundary of both

    def spans_of(offsets) -> list[int]:
        out = []
        for off in offsets:
            s = off[0]
            if getattr(off, "special", False) or s >= s_len:
                out.append(-1)
            else:
                out.append(bisect.bisect_right(cuts, s))  # the span holding character s
        return out

    return SpanAlignment(
        student_span=spans_of(student_offsets), teacher_span=spans_of(teacher_offsets), n_spans=len(cuts)
    )


def align_response(student_tokenizer, teacher_tokenizer, ids: Sequence[int]) -> tuple[str, list[int], SpanAlignment]:
    """The three steps for one response: (its text, the teacher's ids of that text, the alignment of the
    student's `ids` with them): decode_with_offsets, retokenize, align_by_chars."""
    text, s_offsets = decode_with_offsets(student_tokenizer, ids)
    t_ids, t_offsets = retokenize(text, teacher_tokenizer)
    return text, t_ids, align_by_chars(s_offsets, t_offsets)


def alignment_report(student_tokenizer, teacher_tokenizer, texts: Sequence[str] | None = None) -> list[str]:
    """Start-up log lines for a teacher with another tokenizer: how the two vocabularies relate (regular
    tokens of the student that spell a teacher token exactly) and how finely the two tokenizations of
    `texts` (default: data.vocab's probe texts) align, so that a run says which mode applies and why."""
    from megaopd.data.vocab import DEFAULT_PROBES

    def spellings(tok) -> set[str]:
        specials = special_ids(tok)  # once: not per id (O(V x added) at a real teacher's 262k ids)
        regular = [i for i in range(len(tok)) if i not in specials]
        backend = getattr(tok, "backend_tokenizer", None)
        # A vocabulary's worth of small lists and strings: without the collector's passes over every object of
        # the process (~500k with two real tokenizers loaded), which took 20x the work itself (0.46 s -> 0.02).
        with _collector_paused():
            if backend is not None:
                return set(backend.decode_batch([[i] for i in regular], skip_special_tokens=False))
            return {tok.decode([i]) for i in regular}

    s_spell, t_spell = spellings(student_tokenizer), spellings(teacher_tokenizer)
    n_s = n_t = n_spans = 0
    for text in texts if texts is not None else DEFAULT_PROBES:
        ids = student_tokenizer.encode(text, add_special_tokens=False)
        _, t_ids, al = align_response(student_tokenizer, teacher_tokenizer, ids)
        n_s, n_t, n_spans = n_s + len(ids), n_t + len(t_ids), n_spans + al.n_spans
    return [
        f"[vocab] the teacher has another tokenizer ({len(student_tokenizer)} student ids, "
        f"{len(teacher_tokenizer)} teacher ids; {len(s_spell & t_spell)} of the student's {len(s_spell)} regular "
        f"token texts are teacher tokens too): responses are re-tokenized and aligned by characters",
        f"[vocab] on {len(texts if texts is not None else DEFAULT_PROBES)} probe texts {n_s} student tokens "
        f"and {n_t} teacher tokens make {n_spans} spans ({n_s / max(n_spans, 1):.2f} student tokens a span); "
        f"opd and stable_opd take rewards over spans, gkd and lsm are refused (docs/algorithms.md 1.13)",
    ]


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off for a burst of allocations that make no cycles (as it was on entry
    afterwards)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def spread_span_logprobs(
    teacher_logprobs_T: torch.Tensor, alignment: SpanAlignment
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per student token, (teacher log-prob, span id): the span's summed teacher log-prob spread evenly over
    its student tokens (so the student tokens of a span sum to the teacher's span log-prob exactly), and the
    span ids (long). A student token with no span (-1) gets 0, which the caller masks; a teacher token with
    no span adds to nothing.

    teacher_logprobs_T: [n_teacher] (one per teacher token of the alignment). Returns two [n_student]."""
    if teacher_logprobs_T.shape != (len(alignment.teacher_span),):
        raise ValueError(
            f"teacher_logprobs_T has shape {tuple(teacher_logprobs_T.shape)}; the alignment has "
            f"{len(alignment.teacher_span)} teacher tokens"
        )
    device = teacher_logprobs_T.device
    t_span = torch.tensor(alignment.teacher_span, dtype=torch.long, device=device)
    s_span = torch.tensor(alignment.student_span, dtype=torch.long, device=device)
    n = alignment.n_spans
    # Slot n collects the -1s of both sides and is dropped.
    sums = torch.zeros(n + 1, dtype=teacher_logprobs_T.dtype, device=device)
    sums.index_add_(0, torch.where(t_span >= 0, t_span, n), teacher_logprobs_T)
    s_slot = torch.where(s_span >= 0, s_span, n)
    counts = torch.zeros(n + 1, dtype=teacher_logprobs_T.dtype, device=device)
    counts.index_add_(0, s_slot, torch.ones_like(s_slot, dtype=teacher_logprobs_T.dtype))
    values = torch.where(s_span >= 0, sums[s_slot] / counts[s_slot].clamp(min=1), torch.zeros_like(sums[s_slot]))
    return values, s_span
