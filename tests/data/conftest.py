"""Fixtures of the data tests: the tiny tokenizer, a teacher variant with another chat template, and
hand-made OpenR1-Math rows written to parquet and jsonl."""

import json
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
TINY_DATA = os.path.join(ROOT, "examples", "tiny", "data")

# An R1-distill-like template: the generation prompt opens the think block.
TEACHER_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="session")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


@pytest.fixture(scope="session")
def teacher_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("teacher_tok")
    for f in os.listdir(TINY_TOKENIZER):
        shutil.copy(os.path.join(TINY_TOKENIZER, f), d / f)
    (d / "chat_template.jinja").write_text(TEACHER_TEMPLATE)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEACHER_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return AutoTokenizer.from_pretrained(str(d))


def raw_row(i, gens, correct, complete=None, answer="4", **extra):
    """A row in the OpenR1-Math-220k schema (the columns megaopd reads, plus a few it ignores)."""
    row = {
        "problem": f"Compute 2 + {i}.",
        "solution": "ref",
        "answer": answer,
        "problem_type": "Algebra",
        "question_type": "math-word-problem",
        "source": "olympiads",
        "uuid": f"u{i}",
        "is_reasoning_complete": complete if complete is not None else [True] * len(gens),
        "generations": gens,
        "correctness_math_verify": correct,
        "correctness_llama": None,
        "finish_reasons": ["stop"] * len(gens),
        "correctness_count": sum(c is True for c in correct),
        "messages": [{"role": "user", "content": "q"}],
    }
    row.update(extra)
    return row


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)
