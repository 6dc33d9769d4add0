"""megaopd.data: prompts and golden solutions for OPD and Stable-OPD.

    from megaopd.data import DataConfig, PromptDataset, PromptLoader, golden_batch
    data = PromptDataset.load(cfg.data, tokenizer)                  # load, filter, tokenize; DataError early
    loader = PromptLoader(data, cfg.data, batch_size=64, dp_rank=r, dp_size=dp)
    for ex in loader.next_batch(): ex.prompt_ids, ex.golden_ids, ex.golden_loss_mask, ex.answer

Modules: config (DataConfig), io (row files), openr1 (schema, golden filter, split), templates (prompts),
tokenize (ids and loss masks), special_tokens (rollout stop ids = the goldens' end), vocab (the
student/teacher vocabulary check and the special ids to mask), sampler (deterministic mixture order),
dataset (the two classes above), synthetic (the tiny arithmetic/algebra data of examples/tiny).
Tools: tools/prepare_openr1_math.py, tools/build_tiny_data.py.
"""

from megaopd.data.config import DEFAULT_INSTRUCTION, DataConfig, FilterConfig, SourceConfig
from megaopd.data.dataset import PromptDataset, PromptLoader
from megaopd.data.openr1 import DataError, GoldenRecord, LoadReport, answer_matches
from megaopd.data.sampler import MixtureSampler
from megaopd.data.special_tokens import StopTokens, rollout_stop_ids, stop_tokens
from megaopd.data.templates import render_prompt
from megaopd.data.tokenize import GoldenBatch, PromptExample, golden_batch
from megaopd.data.vocab import VocabMismatchError, VocabReport, compare_vocab, loss_mask_ids

__all__ = [
    "DataConfig",
    "FilterConfig",
    "SourceConfig",
    "DEFAULT_INSTRUCTION",
    "PromptDataset",
    "PromptLoader",
    "DataError",
    "GoldenRecord",
    "LoadReport",
    "answer_matches",
    "MixtureSampler",
    "render_prompt",
    "GoldenBatch",
    "PromptExample",
    "golden_batch",
    "StopTokens",
    "rollout_stop_ids",
    "stop_tokens",
    "VocabMismatchError",
    "VocabReport",
    "compare_vocab",
    "loss_mask_ids",
]
