"""A cross-tokenizer run's start-up work on real-sized vocabularies (issue 53): a teacher of 262,144 ids with
6,384 added tokens (6,249 special) and a student of 49,152 ids (tests/data/big_tokenizers.py builds both from
nothing, byte-level BPE with random merges, cached under --dir).

Times, one process, what `megaopd train` runs at start-up for a teacher with teacher.tokenizer=own:
    load            both tokenizers from their folders (hf_io.load_tokenizer)
    compare_vocab   the same-vocabulary check that finds the two differ (data.vocab; roles.check_teacher_tokenizers)
    special_ids     the teacher's special ids (data.alignment.special_ids), first call and a cached one
    report          alignment_report: regular spellings of both vocabularies and the probe texts' alignment
    total           check_teacher_tokenizers as the trainer calls it (compare_vocab, then alignment_report)
and prints one table row each.

    python benchmarks/tokenizer_startup.py [--dir /tmp/megaopd_big_tokenizers]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/megaopd_big_tokenizers", help="where the tokenizers are built (once)")
    a = ap.parse_args(argv)
    from tests.data.big_tokenizers import make_big_pair

    rows: list[tuple[str, float, float]] = []  # (what, wall s, CPU s of the process: every thread)

    def timed(name, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        rows.append((name, time.perf_counter() - wall, time.process_time() - cpu))
        return out

    student_dir, teacher_dir = timed("build (once, cached under --dir)", lambda: make_big_pair(a.dir))

    from types import SimpleNamespace

    from megaopd.data.alignment import alignment_report, special_ids
    from megaopd.data.vocab import VocabMismatchError, compare_vocab
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.trainer.roles import check_teacher_tokenizers

    student, teacher = timed("load both tokenizers", lambda: (load_tokenizer(student_dir), load_tokenizer(teacher_dir)))

    def compare():
        try:
            compare_vocab(student, teacher)
        except VocabMismatchError:
            pass

    timed("compare_vocab (refuses: another vocabulary)", compare)
    n_special = len(timed("special_ids(teacher), first call", lambda: special_ids(teacher)))
    timed("special_ids(teacher), again (cached)", lambda: special_ids(teacher))
    timed("alignment_report", lambda: alignment_report(student, teacher))
    teacher_cfg = SimpleNamespace(name="teacher", path=teacher_dir, tokenizer="own")
    timed(
        "total: check_teacher_tokenizers (compare + report)",
        lambda: check_teacher_tokenizers(student, student_dir, [teacher_cfg], [teacher], (), lambda line: None, set()),
    )

    added = len(teacher.added_tokens_decoder)
    print(f"student {len(student)} ids, teacher {len(teacher)} ids ({added} added, {n_special} special)")
    print("| step | wall s | CPU s |\n|---|---:|---:|")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
