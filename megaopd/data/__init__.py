"""megaopd.data: prompts and golden solutions for OPD and Stable-OPD.

    from megaopd.data import DataConfig, PromptDataset, PromptLoader, golden_batch
    data = PromptDataset.load(cfg.data, tokenizer)                  # load, filter, tokenize; DataError early
    loader = PromptLoader(data, cfg.data, batch_size=64, dp_rank=r, dp_size=dp)
    for ex in loader.next_batch(): ex.prompt_ids, ex.golden_ids, ex.golden_loss_mask, ex.answer

Modules: config (DataConfig), io (row files), openr1 (schema, golden filter, split), templates (prompts),
tokenize (ids and loss masks), sampler (deterministic mixture order), dataset (the two classes above),
synthetic (the tiny arithmetic/algebra data of examples/tiny). Tools: tools/prepare_openr1_math.py,
tools/build_tiny_data.py.
"""
from megaopd.data.config import DEFAULT_INSTRUCTION, DataConfig, FilterConfig, SourceConfig
from megaopd.data.dataset import PromptDataset, PromptLoader
from megaopd.data.openr1 import DataError, GoldenRecord, LoadReport, answer_matches
from megaopd.data.sampler import MixtureSampler
from megaopd.data.templates import render_prompt
from megaopd.data.tokenize import GoldenBatch, PromptExample, golden_batch

__all__ = ["DataConfig", "FilterConfig", "SourceConfig", "DEFAULT_INSTRUCTION", "PromptDataset", "PromptLoader",
           "DataError", "GoldenRecord", "LoadReport", "answer_matches", "MixtureSampler", "render_prompt",
           "GoldenBatch", "PromptExample", "golden_batch"]
