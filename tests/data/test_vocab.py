"""The student/teacher vocabulary check (data.vocab) on tiny tokenizers mimicking the paper's pairs:
Qwen2.5-Math base + OpenThinker3 (EOS differs), + DeepSeek-R1-Distill-Qwen (special ids renamed), and a
genuinely different vocabulary (refused)."""

import pytest
import torch

from megaopd.data.config import DataConfig
from megaopd.data.special_tokens import stop_tokens
from megaopd.data.vocab import VocabMismatchError, compare_vocab, loss_mask_ids, resolve_token_names
from tests.data.tiny_vocab import QWEN_ADDED, make_tokenizer, openthinker, other_family, qwen_math_base, r1_distill


def _ids(tok, *names):
    return [tok.convert_tokens_to_ids(n) for n in names]


def test_same_tokenizer_family_with_another_eos_is_accepted_and_nothing_masked():
    student, teacher = qwen_math_base(), openthinker()
    stop = stop_tokens(DataConfig(), student)
    report = compare_vocab(student, teacher, "qwen-math", "openthinker", stop_ids=stop.ids)
    assert report.diffs == () and report.mask_ids == ()
    assert report.student_eos == ("<|endoftext|>", student.eos_token_id)
    assert report.teacher_eos == ("<|im_end|>", teacher.eos_token_id)
    lines = report.log_lines()
    assert "EOS differs" in lines[1] and "<|endoftext|>" in lines[1] and "<|im_end|>" in lines[1]
    assert len(lines) == 2
    # Identical tokenizers: one line, nothing else.
    assert compare_vocab(student, qwen_math_base()).log_lines()[1:] == []


def test_r1_distill_renamed_specials_are_masked_except_the_shared_end_of_sequence():
    student, teacher = qwen_math_base(), r1_distill()
    stop = stop_tokens(DataConfig(), student)  # student template: ChatML, stops at <|im_end|> and <|endoftext|>
    report = compare_vocab(student, teacher, stop_ids=stop.ids)
    eot, im_start, im_end = _ids(student, "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    # The same ids as in the released tokenizers (151643-151645 there): renamed, not moved.
    assert report.renamed_ids == tuple(_ids(student, *QWEN_ADDED))
    assert _ids(teacher, "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>") == [eot, im_start, im_end]
    # The student's turn end reads as <｜Assistant｜> to the teacher: masked. Its EOS is the teacher's EOS: kept.
    assert im_end in report.mask_ids and im_start in report.mask_ids and eot not in report.mask_ids
    by_id = {d.id: d for d in report.diffs}
    assert by_id[im_end].student == "<|im_end|>" and by_id[im_end].teacher == "<｜Assistant｜>"
    assert "stop token" in by_id[im_end].why and not by_id[eot].masked
    lines = "\n".join(report.log_lines())
    assert "id %d: student <|im_end|>, teacher <｜Assistant｜>: masked in the loss" % im_end in lines
    assert "ends the response for both" in lines


def test_teacher_template_stop_is_kept_when_it_ends_the_response_for_both():
    student, teacher = qwen_math_base(), r1_distill()
    cfg = DataConfig(prompt_template="teacher")
    stop = stop_tokens(cfg, student, teacher)
    eot, im_end = _ids(student, "<|endoftext|>", "<|im_end|>")
    # Teacher template: goldens end with R1's turn end (the student's EOS id); the student's own turn end
    # also stops a rollout.
    assert stop.ids == (eot, im_end) and stop.golden_id == eot
    report = compare_vocab(student, teacher, stop_ids=stop.ids)
    assert eot not in report.mask_ids and im_end in report.mask_ids


def test_student_only_and_teacher_only_special_ids():
    student = make_tokenizer(QWEN_ADDED + ["<|extra|>"], "<|endoftext|>")
    teacher = make_tokenizer(QWEN_ADDED[:5], "<|endoftext|>")
    report = compare_vocab(student, teacher)
    extra = student.convert_tokens_to_ids("<|extra|>")
    assert extra in report.mask_ids and {d.id: d for d in report.diffs}[extra].teacher is None
    back = compare_vocab(teacher, student)  # ids only the teacher has: the student cannot emit them
    assert back.mask_ids == () and {d.student for d in back.diffs} == {None}


def test_a_different_regular_vocabulary_is_refused_naming_tokens():
    pattern = r"does not match the student's.*only in the student's, e\.g\. \["
    with pytest.raises(VocabMismatchError, match=pattern) as e:
        compare_vocab(qwen_math_base(), other_family(), "s_dir", "t_dir")
    msg = str(e.value)
    assert "t_dir" in msg and "s_dir" in msg and "pick a teacher of the student's family" in msg
    assert isinstance(e.value, ValueError)


def test_same_vocab_map_but_other_normalizer_is_refused_by_the_probe_texts():
    from tokenizers import normalizers

    student, teacher = qwen_math_base(), qwen_math_base()
    teacher.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(VocabMismatchError, match="encodes to student"):
        compare_vocab(student, teacher)


def test_loss_mask_ids_feed_the_first_occurrence_masking():
    from megaopd.losses import mask_first_occurrences

    student, teacher = qwen_math_base(), r1_distill()
    stop = stop_tokens(DataConfig(), student)
    report = compare_vocab(student, teacher, stop_ids=stop.ids)
    ids = loss_mask_ids(student, ["<|endoftext|>"], report)
    eot, im_end = _ids(student, "<|endoftext|>", "<|im_end|>")
    assert ids[0] == eot and im_end in ids and len(ids) == len(set(ids))
    # A rollout that ends with the student's turn end: that position leaves the loss, the rest stays.
    resp = student("x = 5.", add_special_tokens=False)["input_ids"] + [im_end]
    targets = torch.tensor([resp])
    mask = mask_first_occurrences(targets, torch.ones_like(targets, dtype=torch.float32), report.mask_ids)
    assert mask[0, :-1].all() and mask[0, -1] == 0
    with pytest.raises(ValueError, match="mask_first_tokens names '<nope>'"):
        resolve_token_names(student, ["<nope>"])


def test_roles_check_same_tokenizer_is_the_thin_wrapper():
    from megaopd.trainer.roles import check_same_tokenizer

    report = check_same_tokenizer(qwen_math_base(), r1_distill(), "s", "t")
    assert report.mask_ids
    with pytest.raises(ValueError, match="does not match the student's"):
        check_same_tokenizer(qwen_math_base(), other_family(), "s", "t")


def test_teacher_prompt_own_renders_the_teachers_template_for_the_teacher_only():
    from megaopd.data.openr1 import GoldenRecord
    from megaopd.data.tokenize import build_examples

    student, teacher = qwen_math_base(), r1_distill()
    rec = GoldenRecord("a", "Solve 3x + 5 = 20.", "5", golden="x = 5.")
    ex = build_examples([rec], "s", DataConfig(teacher_prompt="own"), student, teacher)[0][0]
    assert ex.prompt_text.startswith("<|im_start|>user\n")  # the student generates in its own format
    assert teacher.decode(ex.teacher_prompt_ids).startswith("<｜begin▁of▁sentence｜><｜User｜>Solve")
    assert teacher.decode(ex.teacher_prompt_ids).endswith("<｜Assistant｜><think>\n")
    assert build_examples([rec], "s", DataConfig(), student, teacher)[0][0].teacher_prompt_ids is None
    with pytest.raises(ValueError, match="data.teacher_prompt=own needs the teacher's tokenizer"):
        build_examples([rec], "s", DataConfig(teacher_prompt="own"), student)
    with pytest.raises(ValueError, match="data.teacher_prompt='mine'"):
        DataConfig(teacher_prompt="mine")
    # A teacher prompt over the budget skips the row like a student prompt over it.
    from tests.data.tiny_vocab import R1_ADDED, R1_TEMPLATE

    wordy = make_tokenizer(
        R1_ADDED,
        "<｜end▁of▁sentence｜>",
        "A careful mathematician checks every step twice, then answers within \\boxed{}. " * 3 + R1_TEMPLATE,
    )
    ex = build_examples([rec], "s", DataConfig(teacher_prompt="own"), student, wordy)[0][0]
    n = len(ex.teacher_prompt_ids)
    assert len(ex.prompt_ids) < n
    kept, skipped, _ = build_examples(
        [rec], "s", DataConfig(teacher_prompt="own", max_prompt_len=n - 1), student, wordy
    )
    assert kept == [] and skipped == {f"prompt over max_prompt_len={n - 1} tokens": 1}
