import json

import pytest


def build_tiny_hf(path):
    """A random 2-layer Qwen2 and a byte-level BPE tokenizer with a chat template, saved in HF format."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    corpus = [
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "What is 1+1? The answer is \\boxed{2}. Compute \\frac{1}{2} + 0.5 = 1. x^2 + y^2 (1, 2) 3 4 5 6 7 8 9 0",
    ] * 5
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus,
        vocab_size=320,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    return str(build_tiny_hf(tmp_path_factory.mktemp("tiny_hf")))


@pytest.fixture()
def tiny_bench(tmp_path):
    rows = [
        {"id": "a", "problem": "What is 1+1?", "answer": "2"},
        {"id": "b", "problem": "What is $\\frac{1}{2} + \\frac{1}{2}$?", "answer": "1"},
        {"id": "c", "problem": "Compute 3*3.", "answer": "9"},
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs on one intra-op thread (tests/conftest.py)."""
