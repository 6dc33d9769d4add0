"""DataConfig validation and the trainer-facing PromptDataset/PromptLoader on the tiny data."""

import os

import pytest
from omegaconf import OmegaConf

from megaopd.data import DataConfig, DataError, PromptDataset, PromptLoader, SourceConfig
from tests.data.conftest import TINY_DATA, raw_row, write_jsonl


def test_config_errors_name_the_path_and_fix(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist.*build_tiny_data"):
        SourceConfig(path=str(tmp_path / "nope.jsonl")).check_files()  # at start-up (DataConfig.validate)
    with pytest.raises(ValueError, match="weight"):
        SourceConfig(path=os.path.join(TINY_DATA, "opd.jsonl"), weight=0)
    with pytest.raises(ValueError, match="prompt_template"):
        DataConfig(prompt_template="chat")
    with pytest.raises(ValueError, match="{problem}"):
        DataConfig(user_format="no placeholder")
    with pytest.raises(ValueError, match="data.sources is empty"):
        DataConfig().validate()
    # Relative preset paths resolve from the repository root too, and names default to the file stem.
    assert SourceConfig(path="examples/tiny/data/opd.jsonl").name == "opd"


def test_omegaconf_structured_round_trip():
    cfg = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        OmegaConf.create({"sources": [{"path": "examples/tiny/data/opd.jsonl", "weight": 2}], "max_prompt_len": 128}),
    )
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj.sources[0], SourceConfig) and obj.sources[0].weight == 2 and obj.max_prompt_len == 128


def test_tiny_sources_mix_and_resume(tok):
    cfg = DataConfig(
        sources=[
            SourceConfig(path="examples/tiny/data/opd.jsonl", weight=3, max_rows=60),
            SourceConfig(path="examples/tiny/data/sft.jsonl", weight=1, max_rows=20),
        ],
        max_prompt_len=128,
        max_golden_len=160,
        seed=5,
    )
    data = PromptDataset.load(cfg, tok, log=None)
    assert data.names == ["opd", "sft"] and data.sizes == [60, 20]
    assert data.reports[0].rows == 60 and data.reports[0].kept == 60
    ex = data[(0, 0)]
    assert ex.has_golden and ex.golden.startswith("<think>") and ex.golden_ids[-1] == tok.eos_token_id
    loaders = [PromptLoader(data, cfg, batch_size=8, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        for ld in loaders:
            ld.next_batch()
    state = loaders[1].state_dict()
    nxt = [loaders[1].next_batch() for _ in range(4)]
    again = PromptLoader(data, cfg, batch_size=8, dp_rank=1, dp_size=2)
    again.load_state_dict(state)
    assert [[e.uid for e in b] for b in (again.next_batch() for _ in range(4))] == [[e.uid for e in b] for b in nxt]
    assert [e.uid for e in again.batch_at_step(3)] == [e.uid for e in nxt[0]]
    r0, r1 = loaders[0].batch_at_step(0), loaders[1].batch_at_step(0)
    assert len(r0) == len(r1) == 4 and not {e.uid for e in r0} & {e.uid for e in r1}


def test_empty_source_raises_data_error_naming_file(tmp_path, tok):
    path = write_jsonl(tmp_path / "wrong_only.jsonl", [raw_row(0, ["\\boxed{5}"], [False])])
    cfg = DataConfig(sources=[SourceConfig(path=path)])
    with pytest.raises(DataError, match="wrong_only.jsonl.*no verified generation x1.*require_golden=false"):
        PromptDataset.load(cfg, tok, log=None)
    # As a prompt-only source the same row is usable (e.g. plain OPD without mixture distillation).
    raw = write_jsonl(tmp_path / "prompts.jsonl", [{"problem": "Compute 1 + 2.", "answer": "3"}])
    data = PromptDataset.load(DataConfig(sources=[SourceConfig(path=raw)], require_golden=False), tok, log=None)
    assert data.sizes == [1] and not data[(0, 0)].has_golden


def test_non_utf8_bytes_are_refused_naming_the_file_and_line_or_counted_never_replaced(tmp_path):
    """Issue 53: bytes that are not UTF-8 silently became U+FFFD (data/io.py read with errors='replace')."""
    from megaopd.data.io import NonUtf8Error, iter_rows

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"problem": "ok"}\n{"problem": "caf\xe9"}\n{"problem": "fine"}\n')
    with pytest.raises(NonUtf8Error) as e:
        list(iter_rows([str(path)]))
    assert str(e.value).startswith(f"{path}:2: byte 0xe9 at column 17 is not UTF-8: convert the file to UTF-8")
    assert "data.non_utf8=skip" in str(e.value)
    rows = list(iter_rows([str(path)], non_utf8="skip"))
    assert rows == [(f"{path}:1", {"problem": "ok"}), (f"{path}:2", "not UTF-8"), (f"{path}:3", {"problem": "fine"})]
    array = tmp_path / "rows.json"
    array.write_bytes(b'[\n{"problem": "ok"},\n{"problem": "\xff"}\n]\n')
    with pytest.raises(NonUtf8Error, match=rf"^{array}:3: byte 0xff"):
        list(iter_rows([str(array)]))
    assert list(iter_rows([str(array)], non_utf8="skip")) == [(f"{array}:3", "not UTF-8 (the whole .json array)")]
