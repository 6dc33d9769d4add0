"""The embedded engine's model runner: an HF transformers causal LM that generates rows, scores prompts,
loads HF-named weights and releases its memory, with SGLang's semantics.

    runner = ModelRunner(EmbeddedEngineConfig(hf_dir="path/to/hf"))
    results = runner.run([RowRequest(prompt_ids=[1, 2, 3], max_new_tokens=32, seed=0)])
    runner.update_weights(actor_hf_named_tensors, weight_version="step-7")
    runner.update_adapter(AdapterUpdate.of(peft_named_lora_tensors, rank, alpha, "lora-step-7"))  # LoRA alone

Log-probs are log softmax(logits / T) of each sampled token before top-k/top-p filtering
(megaopd.engine.sampling); a row that ends on EOS or a stop id finishes "stop" (the stop token is in
output_ids), one that uses max_new_tokens finishes "length". How a run is decoded (static KV cache,
continuous batching): megaopd.engine.decode; weight names: megaopd.engine.weights; memory release:
megaopd.engine.memory. The trainer uses it as an
Engine through megaopd.rollout.embedded, `megaopd serve` through megaopd.serving.

Concurrency: one run decodes at a time, and holds the model; weight loads and memory release wait for
it. A run may carry a StepControl (a server's pause / abort / retract: megaopd.serving.scheduling), which
the runner asks before the run and between two decode steps: while it holds the run, the model is free
and weight loads go ahead between those two steps; when it ends a hold "retracting", the running rows are
re-prefilled (prompt + tokens so far) under the new weights, otherwise they keep their KV cache; when it
aborts the run, its running and waiting rows finish "abort". The trainer's runs carry none.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
from typing import Callable, Iterable, Protocol

import torch

from megaopd.engine import attention, memory
from megaopd.engine.cache import SlotCache
from megaopd.engine.config import (
    CACHE_ROUND,
    CUDA_SYNC_EVERY,
    DTYPES,
    EmbeddedEngineConfig,
    cache_positions,
    read_eos_ids,
)
from megaopd.engine.decode import Decoder, StepAction, decode_rows
from megaopd.engine.forward import Forward
from megaopd.engine.lora import AdapterMerge, AdapterUpdate
from megaopd.engine.memory import EngineReleasedError
from megaopd.engine.rows import PromptScores, RowRequest, RowResult
from megaopd.engine.weights import WeightTable


class StepControl(Protocol):
    """What a run asks, before the run and between two decode steps, of whoever may pause it."""

    def held(self) -> bool:
        """Wait (the model free for weight loads) before going on."""

    def aborted(self) -> bool:
        """End the run's running and waiting rows with finish reason "abort"."""

    def retracting(self) -> bool:
        """A hold asks the running rows to be re-prefilled when it ends (their KV cache is recomputed)."""


class _Unheld:
    """The control of a run nobody pauses (the trainer's)."""

    def held(self) -> bool:
        return False

    def aborted(self) -> bool:
        return False

    def retracting(self) -> bool:
        return False


UNHELD: StepControl = _Unheld()


class ModelRunner:
    """An HF causal LM in this process; see the module docstring."""

    def __init__(self, config: EmbeddedEngineConfig):
        from transformers import AutoModelForCausalLM

        self.config = config
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        # "sdpa" is transformers' SDPA with decode steps' queries packed onto the KV heads (megaopd.engine.attention)
        attn = attention.register() if config.attn_implementation == "sdpa" else config.attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(config.hf_dir, dtype=self.dtype, attn_implementation=attn)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.eos_ids = list(config.eos_token_ids) if config.eos_token_ids is not None else read_eos_ids(config.hf_dir)
        mc = self.model.config
        self.vocab_size = int(mc.vocab_size)
        self.pad_id = (
            int(mc.pad_token_id) if getattr(mc, "pad_token_id", None) is not None else (self.eos_ids or [0])[0]
        )
        cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._forward = Forward(self.model, self.device, self.pad_id, cache_kw, compile=config.compile_decode)
        self.tokenizer = _try_load_tokenizer(config.hf_dir) if config.load_tokenizer else None
        self.release_weights = config.release_weights
        if self.release_weights == "auto":
            self.release_weights = "offload" if self.device.type == "cuda" else "keep"
        self.weight_version = "default"
        # One condition guards the model: a decoding run holds it (releasing it only while its control
        # holds the run), weight loads and memory release take it.
        self._cond = threading.Condition(threading.Lock())
        self._waiting_updates = 0  # weight loads queued: new runs wait so loads are not starved
        self._released: set[str] = set()  # memory tags released and not resumed since
        self._stale: set[str] = set()  # parameters discarded and not yet reloaded
        self._discarded_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        # The names update_weights speaks (the HF checkpoint's, as SGLang and megaopd's gather send them).
        self._weights = WeightTable(self.model.state_dict(keep_vars=True))
        self._adapter = AdapterMerge()  # the base values of the weights the current adapter changed
        self.running = 0  # rows currently decoding, for /get_server_info style reporting
        # The static KV cache (allocated at the first run, kept until release_memory("kv_cache")) and the
        # decode steps captured as CUDA graphs over it (megaopd.engine.graphs; none on CPU).
        self._cache: SlotCache | None = None
        self._graphs = None
        self.sync_every = config.sync_every or (CUDA_SYNC_EVERY if self.device.type == "cuda" else 1)
        self.admit_min = config.admit_min or (max(1, config.max_batch_size // 8) if self.device.type == "cuda" else 1)

    # ----------------------------------------------------------------------------------- generation
    def run(self, rows: list[RowRequest], control: StepControl = UNHELD) -> list[RowResult]:
        """Generates every row (max_batch_size at a time, a finished row's slot going to a waiting row:
        megaopd.engine.decode); results in row order.

        control: who may hold or abort the run (see the module docstring); a run also waits for queued
        weight loads, so they are not starved.
        """
        for r in rows:
            self.check_row(r)
        with self._cond:
            while control.held() or self._waiting_updates:
                if control.aborted():
                    break
                self._cond.wait(timeout=0.5)
            if control.aborted():
                return [RowResult(finish_reason="abort", weight_version=self.weight_version) for _ in rows]
            if self._kv_released or self._weights_released or self._stale:
                raise EngineReleasedError(self._released_message())
            if not rows:
                return []
            self.running += len(rows)
            # On CUDA the engine's device is the current one while it decodes: graph capture, its side stream
            # and replays use the current device, whatever `device` names (cuda:1 from `megaopd serve`).
            on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
            try:
                with on_device:
                    return decode_rows(
                        self._decoder(rows),
                        rows,
                        self.weight_version,
                        lambda: self._boundary(control),
                        self.sync_every,
                        self.admit_min,
                    )
            finally:
                self.running -= len(rows)
                self._cond.notify_all()

    def _decoder(self, rows: list[RowRequest]) -> Decoder:
        """The decode step over the static cache, (re)allocated when a row needs more positions than it has."""
        longest = max(len(r.prompt_ids) + r.max_new_tokens for r in rows)
        if self._cache is None or self._cache.capacity < longest + self.sync_every:
            self._cache, self._graphs = None, None
            gc.collect()
            slots = self.config.max_batch_size
            capacity = cache_positions(max(longest, self.config.context_length), self.sync_every)
            if self.device.type == "cuda":
                capacity = self._cuda_capacity(slots, capacity)
            self._cache = SlotCache(self.model.config, slots, capacity, self.device, self.dtype)
        if self._graphs is None and self.device.type == "cuda" and self.config.cuda_graph_bs != []:
            from megaopd.engine.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self._forward, self._cache, self.config.cuda_graph_bs)
        return Decoder(self._forward, self._cache, self._graphs)

    def _drop_graphs(self) -> None:
        """Forgets the captured graphs, and turns them off for a decode still running with them (a release and
        resume inside one pause): it goes on eagerly rather than replaying over moved or freed storage."""
        if self._graphs is not None:
            self._graphs.off = "memory moved"
        self._graphs = None

    def _cuda_capacity(self, slots: int, need: int) -> int:
        """Positions per slot on CUDA: `need` when context_length is set (the trainer's engines), else as many
        as fit in mem_fraction_static of the GPU (as SGLang sizes its KV pool), at most the model's context;
        ValueError naming the fix when `need` does not fit in mem_fraction_static."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(free, self.config.mem_fraction_static * total - (total - free))
        per_slot = SlotCache.bytes_per_token(self.model.config, self.dtype) * slots
        fits = int(budget // per_slot) // CACHE_ROUND * CACHE_ROUND
        if fits < need:
            raise ValueError(
                f"the KV cache needs {need} positions x {slots} slots but mem_fraction_static="
                f"{self.config.mem_fraction_static} leaves room for {fits}; lower max_batch_size "
                "or max_new_tokens, or raise mem_fraction_static"
            )
        if self.config.context_length:
            return need
        limit = getattr(self.model.config, "max_position_embeddings", None) or fits
        return max(need, min(fits, cache_positions(int(limit), self.sync_every)))

    def _boundary(self, control: StepControl) -> StepAction:
        """Between two decode steps, the model held: the only place a pause, an abort or a weight load
        (while held: the wait releases the model) can intervene."""
        retract = False
        while control.held() and not control.aborted():
            retract |= control.retracting()
            self._cond.wait(timeout=0.5)
        if control.aborted() or self._kv_released or self._weights_released:
            return "abort"  # aborted, or memory was released while held: the running rows cannot continue
        return "retract" if retract else "go"

    def wake(self) -> None:
        """Makes a run waiting at a hold look at its control again (call after changing what it answers).
        Never blocks: a run that is computing holds the model and looks at its next step boundary anyway."""
        if self._cond.acquire(timeout=0.0):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()

    def check_row(self, r: RowRequest) -> None:
        """ValueError naming the problem when a row cannot run (bad ids, empty prompt, too long)."""
        if not r.prompt_ids:
            raise ValueError("empty prompt: every prompt needs at least one token id")
        bad = [t for t in r.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={r.max_new_tokens} must be at least 1")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and len(r.prompt_ids) + r.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds "
                f"the model's context of {limit} tokens"
            )

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """log softmax(logits) (temperature 1, as SGLang's input_token_logprobs) of each prompt token
        given its prefix; the first token has none."""
        return [None] + self.prompt_scores(prompt_ids).logprobs

    @torch.inference_mode()
    def prompt_scores(
        self, prompt_ids: list[int], top_k: int = 0, at_ids: list[int] | None = None, first: int = 1
    ) -> PromptScores:
        """Prefill scoring (SGLang's input log-probs, temperature 1) of the prompt's tokens from `first` on
        (1 <= first <= len: token 0 has no prefix): their log-probs given their prefixes; with top_k / at_ids
        also the top_k (id, log-prob) pairs and the log-probs at `at_ids` of the distributions that predict
        them and of the one after the prompt (see PromptScores)."""
        if not 1 <= first <= len(prompt_ids):
            raise ValueError(f"first={first} must be in [1, {len(prompt_ids)}] (token 0 has no prefix)")
        with self._cond:
            if self._kv_released or self._weights_released or self._stale:
                raise EngineReleasedError(self._released_message())
            ids = torch.tensor([prompt_ids], device=self.device)
            logits_LV = self.model(input_ids=ids).logits[0].float()
        lp_RV = torch.log_softmax(logits_LV[first - 1 :], dim=-1)  # rows predict tokens first..L-1, then the next
        out = PromptScores(logprobs=lp_RV[:-1].gather(-1, ids[0, first:].unsqueeze(-1)).squeeze(-1).tolist())
        if top_k:
            vals, idx = lp_RV.topk(min(top_k, lp_RV.shape[-1]), dim=-1)
            out.top_logprobs, out.top_ids = vals.tolist(), idx.tolist()
        if at_ids:
            out.at_ids_logprobs = lp_RV[:, torch.tensor(at_ids, device=lp_RV.device)].tolist()
        return out

    def flush_cache(self) -> bool:
        """No prefix cache here (the KV cache holds running rows only); returns False while rows are
        decoding, like SGLang."""
        return self.running == 0

    def health(self) -> bool:
        return not (self._kv_released or self._weights_released)

    @property
    def released_tags(self) -> frozenset[str]:
        return frozenset(self._released)

    @property
    def _kv_released(self) -> bool:
        return "kv_cache" in self._released

    @property
    def _weights_released(self) -> bool:
        return "weights" in self._released

    def _released_message(self) -> str:
        if self._kv_released or self._weights_released:
            return "memory is released (release_memory); call resume_memory before generating"
        names = sorted(self._stale)
        return (
            f"{len(names)} weights were discarded by release_memory and not reloaded "
            f"(e.g. {names[:4]}); call update_weights with all of them before generating"
        )

    # -------------------------------------------------------------------------------- weights
    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of every loadable tensor (tied aliases included)."""
        return dict(self._weights.specs)

    def check_weights(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Problems (unknown names, shape mismatches, duplicates) that would stop a load; [] when fine."""
        return self._weights.problems(named_shapes)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> None:
        """Loads full HF-named tensors (any subset of the model's weights) by name; all or nothing.

        Raises WeightMismatchError listing every unknown name and shape mismatch; then nothing is loaded.
        Waits for a running batch unless generation is paused.
        """
        named = [(n, t) for n, t in named_tensors]
        self._weights.check([(n, tuple(t.shape)) for n, t in named])
        with self._exclusive():
            with torch.no_grad():
                for name, tensor in named:
                    target = self._weights.view(name)
                    target.copy_(tensor.to(device=target.device))
            self._adapter.forget(n for n, _ in named)  # loaded whole: the new base
            self._loaded([n for n, _ in named], weight_version)

    def update_adapter(self, update: AdapterUpdate) -> None:
        """Generates with the base weights plus `update`'s LoRA adapter from now on: each adapted weight becomes
        W_base + (alpha / r) B A, computed in float32 from the kept base (megaopd.engine.lora.AdapterMerge), and
        a weight the previous adapter changed that this one leaves out returns to its base. All or nothing:
        WeightMismatchError when a name is not the model's or B A's shape is not the weight's."""
        self._weights.check([(n, (b.shape[0], a.shape[1])) for n, (a, b) in update.pairs.items()])
        with self._exclusive():
            if self._stale:
                raise EngineReleasedError(
                    f"{len(self._stale)} weights were discarded by release_memory: load the full weights "
                    "(update_weights) before an adapter update, which merges into them"
                )
            with torch.no_grad():
                for name, base in self._adapter.restore(update.pairs).items():
                    target = self._weights.view(name)
                    target.copy_(base.to(device=target.device))
                for name, pair in update.pairs.items():
                    target = self._weights.view(name)
                    target.copy_(self._adapter.merged(name, target, pair, update.scale))
            self._loaded(list(update.pairs), update.version)

    def receive_weights_in_place(
        self,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        fill: Callable[[list[torch.Tensor]], None],
        weight_version: str | None = None,
    ) -> bool:
        """Zero-copy load: fill(targets) writes straight into the model's tensors (e.g. a broadcast).

        Only when every (name, shape) matches and each dtype equals the model's (else returns False and
        does nothing, so the caller receives into scratch tensors and calls update_weights). Holds the
        model for the duration of fill, as a load does; a fill that fails half-way leaves those weights
        half-updated (as SGLang warns for its own loads).
        """
        if self.check_weights([(n, shape) for n, shape, _ in specs]):
            return False
        targets = [self._weights.view(n) for n, _, _ in specs]
        if any(t.dtype != dt or not t.is_contiguous() for t, (_, _, dt) in zip(targets, specs)):
            return False
        with self._exclusive():
            with torch.no_grad():
                fill(targets)
            self._adapter.forget(n for n, _, _ in specs)
            self._loaded([n for n, _, _ in specs], weight_version)
        return True

    @contextlib.contextmanager
    def _exclusive(self):
        """The model, for a weight load: after the decoding run (or at its pause), before queued runs."""
        self._waiting_updates += 1
        try:
            with self._cond:
                if self._weights_released and not self._stale:
                    raise EngineReleasedError("weights are released; call resume_memory before loading weights")
                yield
        finally:
            self._waiting_updates -= 1
            with self._cond:
                self._cond.notify_all()

    def _loaded(self, names: list[str], weight_version: str | None) -> None:
        for name in names:
            self._stale.discard(self._weights.canonical[name])
        if weight_version is not None:
            self.weight_version = str(weight_version)

    # -------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Frees the KV cache and, per `release_weights`, the weights; tags among MEMORY_TAGS (None = all).
        Releasing a released tag again does nothing."""
        tags = memory.memory_tags(None if tags is None else list(tags), "release_memory")
        with self._cond:
            if "weights" in tags and not self._weights_released:
                if self.release_weights == "offload":
                    self.model.to("cpu")
                elif self.release_weights == "discard":
                    self._discarded_shapes = memory.discard(self._weights.params)
                    self._stale = set(self._weights.canonical.values())  # a fused tensor: until each expert is loaded
            self._released.update(tags)
            if "kv_cache" in tags:
                self._cache = None  # re-allocated by the next run
            self._drop_graphs()  # captured again by the next run: weights or cache may move
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Re-allocates what release_memory freed (discarded weights come back as zeros, still stale).
        MemoryStateError (nothing resumed) when a named tag is not released; None = every tag."""
        tags = memory.check_resume(None if tags is None else list(tags), self._released, "resume_memory")
        with self._cond:
            if "weights" in tags and self._weights_released:
                if self.release_weights == "offload":
                    self.model.to(self.device)
                elif self.release_weights == "discard":
                    memory.restore(self._weights.params, self._discarded_shapes, self.device)
                    self._discarded_shapes = {}
            self._drop_graphs()  # the graphs read the weights' old storage
            self._released.difference_update(tags)

    def model_info(self) -> dict:
        return {
            "model_path": self.config.hf_dir,
            "tokenizer_path": self.config.hf_dir,
            "is_generation": True,
            "weight_version": self.weight_version,
            "device": str(self.device),
            "dtype": self.config.dtype,
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_ids,
        }

    def decode(self, ids: list[int]) -> str:
        """Text of ids when the HF dir has a tokenizer, else "" (the protocol is token ids)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _try_load_tokenizer(hf_dir: str):
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from megaopd.models.hf_io import load_tokenizer

        return load_tokenizer(hf_dir)
    except Exception:  # noqa: BLE001 - text is a convenience; ids are the protocol
        return None
