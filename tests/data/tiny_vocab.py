"""Tiny tokenizers mimicking the paper's student/teacher pairs: one regular byte-level BPE vocabulary, then
added tokens at the same ids under each model's names (Qwen2.5 base/Math, Qwen2.5-Instruct derivatives
such as OpenThinker3, DeepSeek-R1-Distill-Qwen), plus a genuinely different vocabulary."""

import functools

CORPUS = [
    "Solve for x: 3x + 5 = 20. Subtract 5 from both sides, so 3x = 15 and x = 5.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "\\frac{a}{b} + \\sqrt{2} = \\boxed{42}. The answer is 7. Wait, let me check: 1 + 1 = 2.",
] * 4
OTHER_CORPUS = ["zebra quartz jumps over lazy fox; zebra zebra quartz 0 1 2 3 4 5 6 7 8 9"] * 4
"""Another corpus: the BPE trained on it is a genuinely different regular vocabulary."""

# Qwen2.5 names of ids N..N+6 (151643.. in the real tokenizer) and DeepSeek-R1-Distill-Qwen's.
QWEN_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
]
R1_ADDED = [
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<|EOT|>",
    "<think>",
    "</think>",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


@functools.lru_cache(maxsize=None)
def _bpe_json(other: bool) -> str:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(OTHER_CORPUS if other else CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    return bpe._tokenizer.to_str()


def make_tokenizer(added, eos, template=None, bos=None, other_vocab=False):
    """A PreTrainedTokenizerFast: the shared (or the other) regular vocabulary, then `added` in order."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_bpe_json(other_vocab))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=added[0], chat_template=template, **kwargs
    )


def qwen_math_base():
    """Qwen2.5-Math-7B-like: EOS <|endoftext|>, ChatML template closing turns with <|im_end|>."""
    return make_tokenizer(QWEN_ADDED, "<|endoftext|>", CHATML)


def openthinker():
    """OpenThinker3-7B-like (a Qwen2.5-7B-Instruct fine-tune): same names, EOS <|im_end|>."""
    return make_tokenizer(QWEN_ADDED, "<|im_end|>", CHATML)


def r1_distill():
    """DeepSeek-R1-Distill-Qwen-7B-like: the same ids renamed, EOS <｜end▁of▁sentence｜>."""
    return make_tokenizer(R1_ADDED, "<｜end▁of▁sentence｜>", R1_TEMPLATE, bos="<｜begin▁of▁sentence｜>")


def other_family():
    """Another regular vocabulary with Qwen's special names: must be refused."""
    return make_tokenizer(QWEN_ADDED, "<|im_end|>", CHATML, other_vocab=True)
