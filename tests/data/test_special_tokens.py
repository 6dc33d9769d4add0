"""Rollout stop ids and the goldens' last token (data.special_tokens), with a tokenizer whose EOS is not
its chat template's turn end (Qwen2.5-Math base: EOS <|endoftext|>, turns closed by <|im_end|>)."""

import pytest

from megaopd.data import DataConfig, PromptDataset, SourceConfig
from megaopd.data.openr1 import GoldenRecord
from megaopd.data.special_tokens import rollout_stop_ids, stop_tokens, turn_end_token
from megaopd.data.tokenize import build_examples
from tests.data.conftest import write_jsonl
from tests.data.tiny_vocab import qwen_math_base, r1_distill

GOLDEN = "3x = 15, so x = 5. The answer is \\boxed{5}."


def test_stop_ids_are_the_turn_end_then_the_eos_when_they_differ():
    tok = qwen_math_base()
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == eot != im_end and turn_end_token(tok) == "<|im_end|>"
    stop = stop_tokens(DataConfig(), tok)
    assert stop.ids == (im_end, eot) and stop.golden_id == im_end
    assert rollout_stop_ids(DataConfig(), tok) == [im_end, eot]
    assert stop.log_line() == (
        f"[data] rollouts stop at <|im_end|>={im_end}, <|endoftext|>={eot}; golden "
        f"solutions end with <|im_end|>={im_end}"
    )
    # plain: no chat markup, the EOS is both the golden's end and the only stop.
    assert stop_tokens(DataConfig(prompt_template="plain"), tok).ids == (eot,)


def test_goldens_end_with_the_token_rollouts_stop_at():
    tok = qwen_math_base()
    stop = stop_tokens(DataConfig(), tok)
    ex = build_examples([GoldenRecord("a", "Solve 3x + 5 = 20.", "5", golden=GOLDEN)], "s", DataConfig(), tok)[0][0]
    assert int(ex.solution_ids[-1]) == stop.golden_id == stop.ids[0]
    assert int(ex.solution_ids[-1]) != tok.eos_token_id  # the old bug: a base model's EOS ended nothing
    assert tok.decode(ex.solution_ids.tolist()) == GOLDEN + "<|im_end|>"


def test_teacher_template_goldens_end_with_the_teachers_turn_end(tmp_path):
    student, teacher = qwen_math_base(), r1_distill()
    cfg = DataConfig(prompt_template="teacher")
    stop = stop_tokens(cfg, student, teacher)
    end = teacher.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert stop.golden_id == end and student.convert_tokens_to_ids("<|im_end|>") in stop.ids
    with pytest.raises(ValueError, match="teacher's tokenizer"):
        stop_tokens(cfg, student)


def test_dataset_carries_the_stop_ids_its_goldens_end_with(tmp_path):
    tok = qwen_math_base()
    path = write_jsonl(
        tmp_path / "g.jsonl", [{"problem": "Solve 3x + 5 = 20.", "answer": "5", "golden": GOLDEN, "uuid": "a"}]
    )
    lines = []
    data = PromptDataset.load(DataConfig(sources=[SourceConfig(path=path)]), tok, log=lines.append)
    assert data.stop == stop_tokens(DataConfig(), tok) and lines[0] == data.stop.log_line()
    assert all(int(ex.solution_ids[-1]) == data.stop.golden_id for ex in data.examples[0])


def test_the_tiny_presets_tokenizer_stops_once(tok):
    # EOS == turn end (<|im_end|>): one stop id, no duplicate.
    assert stop_tokens(DataConfig(), tok).ids == (tok.eos_token_id,)
