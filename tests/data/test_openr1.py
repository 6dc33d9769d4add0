"""OpenR1-Math schema loading (parquet and jsonl), the golden filter, the split, malformed rows, errors."""

import json
import os
from collections import Counter

import pytest

from megaopd.data.config import DataConfig, FilterConfig, SourceConfig
from megaopd.data.openr1 import (
    DataError,
    LoadReport,
    load_records,
    prepare_splits,
    record_from_row,
    split_records,
    split_sizes,
    token_counter,
)
from tests.data.conftest import raw_row, write_jsonl, write_parquet

GOOD = "<think>\n2 + 2 = 4\n</think>\nThe answer is \\boxed{4}."
WRONG = "<think>\n2 + 2 = 5\n</think>\nThe answer is \\boxed{5}."
LONG = "<think>\n" + "2 + 2 = 4\n" * 40 + "</think>\nThe answer is \\boxed{4}."  # ~200 tiny tokens


def hand_rows():
    return [
        raw_row(0, [GOOD], [True]),
        raw_row(1, [WRONG, GOOD], [False, True]),  # golden is the second generation
        raw_row(2, [WRONG], [False]),  # no verified generation
        raw_row(3, [LONG], [True]),  # only generation too long
        raw_row(4, [LONG, GOOD], [True, True]),  # first too long -> second
        raw_row(5, [GOOD], [True], complete=[False]),  # incomplete reasoning
    ]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_schema_loads_from_parquet_and_jsonl(tmp_path, tok, fmt):
    rows = hand_rows()
    path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"raw.{fmt}", rows)
    report = LoadReport("raw")
    filt = FilterConfig(max_generation_tokens=100)
    recs = load_records([path], filt, token_counter(tok), report, require_golden=True)
    assert [r.uuid for r in recs] == ["u0", "u1", "u4"]
    assert all(r.golden == GOOD and r.answer == "4" and r.source == "olympiads" for r in recs)
    assert recs[0].problem == "Compute 2 + 0." and recs[0].golden_tokens == len(tok(GOOD)["input_ids"])
    assert report.rows == 6 and report.kept == 3
    assert report.skipped == Counter({"no verified generation": 2, "no verified generation within 100 tokens": 1})
    assert report.generations["wrong (math-verify)"] == 2
    assert report.generations["over 100 tokens"] == 2
    assert report.generations["incomplete"] == 1


def test_filter_rules_on_hand_made_rows(tok):
    count = token_counter(tok)
    assert count([LONG])[0] > 100 >= count([GOOD])[0]
    f = FilterConfig(max_generation_tokens=100)
    pick = lambda row, filt=f: record_from_row(row, filt, count, Counter())  # noqa: E731
    assert pick(raw_row(1, [WRONG, GOOD], [False, True]))[0].golden == GOOD
    assert pick(raw_row(2, [WRONG], [False])) == (None, "no verified generation")
    assert pick(raw_row(3, [LONG], [True]))[1] == "no verified generation within 100 tokens"
    # The paper's filter alone (no completeness rule) keeps an incomplete-but-correct trace.
    assert (
        pick(
            raw_row(5, [GOOD], [True], complete=[False]),
            FilterConfig(max_generation_tokens=100, require_complete=False),
        )[0].golden
        == GOOD
    )
    # No length limit: the long trace is kept.
    assert pick(raw_row(3, [LONG], [True]), FilterConfig(max_generation_tokens=0))[0].golden == LONG
    # shortest picks the shorter of two correct traces.
    assert (
        pick(raw_row(4, [LONG, GOOD], [True, True]), FilterConfig(max_generation_tokens=0, golden_choice="shortest"))[
            0
        ].golden
        == GOOD
    )


def test_math_verify_runs_when_the_column_is_missing_or_reverify(tok):
    count = token_counter(tok)
    row = raw_row(1, [WRONG, GOOD], [True, True])  # the column lies about the first generation
    assert record_from_row(row, FilterConfig(), count, Counter())[0].golden == WRONG
    assert record_from_row(row, FilterConfig(reverify=True), count, Counter())[0].golden == GOOD
    del row["correctness_math_verify"]
    assert record_from_row(row, FilterConfig(), count, Counter())[0].golden == GOOD


def test_malformed_rows_are_skipped_and_counted(tmp_path, tok):
    rows = [
        raw_row(0, [GOOD], [True]),
        {"answer": "4", "generations": [GOOD]},  # missing problem
        raw_row(2, [GOOD], [True], answer=None),  # missing answer
        raw_row(3, "not a list", [True]),  # bad generations
        raw_row(4, [GOOD, GOOD], [True]),  # length mismatch
        raw_row(5, [GOOD], ["yes"]),  # non-boolean
        raw_row(6, [GOOD], [True], answer=4),
    ]  # numeric answer: fine
    path = write_jsonl(tmp_path / "bad.jsonl", rows, raw_lines=["{not json", "[1, 2]"])
    report = LoadReport("bad")
    recs = load_records([path], FilterConfig(), token_counter(tok), report)
    assert [r.uuid for r in recs] == ["u0", "u6"] and recs[1].answer == "4"
    assert report.rows == 9 and report.kept == 2
    assert report.skipped == Counter(
        {
            "missing problem": 1,
            "missing answer": 1,
            "generations is not a list of strings": 1,
            "correctness_math_verify is not a list as long as generations": 1,
            "correctness_math_verify holds non-boolean values": 1,
            "invalid json (Expecting property name enclosed in double quotes)": 1,
            "row is not a json object": 1,
        }
    )
    assert report.first_skipped["missing problem"] == f"{path}:2"
    assert "missing problem x1" in report.summary()


def test_empty_result_raises_naming_the_file_and_fix(tmp_path, tok):
    path = write_jsonl(tmp_path / "allbad.jsonl", [raw_row(0, [WRONG], [False])], raw_lines=["oops"])
    with pytest.raises(DataError) as e:
        prepare_splits([path], FilterConfig(), token_counter(tok), [("sft", 3), ("opd", 1)], seed=0)
    msg = str(e.value)
    assert "allbad.jsonl" in msg and "no verified generation x1" in msg and "Fix:" in msg


def test_prompt_only_and_prepared_rows():
    c = Counter()
    rec, _ = record_from_row({"problem": "p", "answer": "1"}, FilterConfig(), None, c)
    assert rec.golden is None and rec.uuid  # stable content id
    assert record_from_row({"problem": "p", "answer": "1"}, FilterConfig(), None, c)[0].uuid == rec.uuid
    rec, _ = record_from_row(
        {"uuid": "a", "problem": "p", "answer": "1", "golden": GOOD, "golden_tokens": 9}, FilterConfig(), None, c
    )
    assert rec.golden == GOOD and rec.golden_tokens == 9
    assert (
        record_from_row({"problem": "p", "answer": "1", "golden": 3}, FilterConfig(), None, c)[1]
        == "golden is not a string"
    )


def test_split_is_deterministic_and_proportional():
    recs = list(range(100))
    a = split_records(recs, [("sft", 33000), ("opd", 13000)], seed=7)
    b = split_records(recs, [("sft", 33000), ("opd", 13000)], seed=7)
    c = split_records(recs, [("sft", 33000), ("opd", 13000)], seed=8)
    assert a == b and a != c
    assert (len(a["sft"]), len(a["opd"])) == (72, 28)  # 100 * 33/46 = 71.7 -> 72
    assert sorted(a["sft"] + a["opd"]) == recs
    assert split_sizes(46000, [("sft", 33000), ("opd", 13000)]) == [("sft", 33000), ("opd", 13000)]
    assert split_sizes(50000, [("sft", 33000), ("opd", 13000)]) == [("sft", 33000), ("opd", 13000)]
    assert split_sizes(3, [("sft", 33000), ("opd", 13000)]) == [("sft", 2), ("opd", 1)]
    small = split_records(recs, [("sft", 10), ("opd", 5)], seed=7)
    assert (len(small["sft"]), len(small["opd"])) == (10, 5)  # exact sizes when there are enough records


def test_prepare_tool_writes_splits_and_manifest(tmp_path, tok):
    import tools.prepare_openr1_math as prep

    rows = [raw_row(i, [WRONG, GOOD] if i % 3 else [WRONG], [False, True] if i % 3 else [False]) for i in range(30)]
    src = write_parquet(tmp_path / "train-00000-of-00001.parquet", rows)
    out = tmp_path / "out"
    args = [
        "--input",
        str(tmp_path),
        "--out",
        str(out),
        "--tokenizer",
        os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny", "tokenizer"),
        "--format",
        "jsonl",
        "--sizes",
        "sft=33000,opd=13000",
    ]
    assert prep.main(args) == 0
    sft = [json.loads(x) for x in open(out / "sft.jsonl")]
    opd = [json.loads(x) for x in open(out / "opd.jsonl")]
    assert (len(sft), len(opd)) == (14, 6)  # 20 kept, 33:13
    assert {r["uuid"] for r in sft}.isdisjoint(r["uuid"] for r in opd)
    assert all(r["golden"] == GOOD and r["golden_tokens"] > 0 for r in sft + opd)
    man = json.load(open(out / "manifest.json"))
    assert man["rows_read"] == 30 and man["rows_kept"] == 20 and man["skipped"] == {"no verified generation": 10}
    assert man["inputs"] == [src]
    # Same inputs and seed: identical files; the prepared rows load back as data sources.
    out2 = tmp_path / "out2"
    assert prep.main(args[:3] + [str(out2)] + args[4:]) == 0
    assert (out / "sft.jsonl").read_bytes() == (out2 / "sft.jsonl").read_bytes()
    report = LoadReport("p")
    back = load_records([str(out / "opd.jsonl")], FilterConfig(), None, report, require_golden=True)
    assert [r.uuid for r in back] == [r["uuid"] for r in opd]
    assert DataConfig(sources=[SourceConfig(path=str(out / "opd.jsonl"))]).sources[0].name == "opd"
