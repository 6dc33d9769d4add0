"""A scripted Engine for tests: canned response texts, so that scoring arithmetic is checked exactly.

Generation itself is tested with the real embedded engine (megaopd.rollout.embedded).
"""

from __future__ import annotations

from megaopd.rollout.protocol import Sample, SamplingParams


class ScriptedEngine:
    """Returns canned response texts in order (one per sequence), to test scoring arithmetic exactly."""

    def __init__(self, tokenizer, texts, finish_reasons=None):
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.reasons = list(finish_reasons or ["stop"] * len(self.texts))
        self.calls = []

    def generate(self, prompts, params: SamplingParams, first_prompt_index: int = 0):
        self.calls.append((len(prompts), params, first_prompt_index))
        out = []
        for p in prompts:
            for _ in range(params.n):
                text, reason = self.texts.pop(0), self.reasons.pop(0)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                out.append(Sample(list(p), ids, [0.0] * len(ids), reason))
        return out
