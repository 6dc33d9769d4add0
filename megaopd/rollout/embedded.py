"""Embedded rollout engine: an HF transformers causal LM sampling batched responses in-process.

The CPU default engine (GPU when present) and the model behind `megaopd serve`. It implements the
Engine protocol (megaopd.rollout.protocol) with SGLang's semantics: log-probs are
log softmax(logits / T) of each sampled token before top-k/top-p filtering, a response that ends on EOS
or a stop id finishes "stop" (the stop token is in output_ids), one that uses max_new_tokens finishes
"length".

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir="path/to/hf"))
    samples = engine.generate([[1, 2, 3]], SamplingParams(n=4, max_new_tokens=32, seed=0))
    engine.update_weights(actor_hf_named_tensors, weight_version="step-7")

Weights are named as in the HF checkpoint (what megaopd's gather and SGLang send). transformers 5 keeps a
MoE layer's experts fused (Qwen3-MoE's mlp.experts.gate_up_proj / down_proj); a per-expert name such as
mlp.experts.3.gate_proj.weight loads into its slice of the fused tensor (fused_expert_slots).

How a batch is decoded: the distinct prompts are left-padded and prefilled once (a prompt's n samples
share its prefill; the KV cache rows are then repeated), then one token per row per step with a
DynamicCache; rows that finish are dropped from the batch and the cache. Each row draws from its own
torch.Generator (seeded from SamplingParams.seed by protocol.expand_samples), so a seeded result does not depend on
which other rows were in the batch (up to float reductions, which batch size can change in the last bit).

Memory release (colocated engines), by `release_weights`:
  keep     weights stay where they are (the CPU default: moving CPU tensors to the CPU frees nothing);
  offload  weights move to the CPU and back on resume (the GPU default);
  discard  weights are freed; resume allocates zeros, and generate refuses to run until every weight
           has been loaded again by update_weights (SGLang without a CPU backup behaves alike).
The KV cache only lives while a batch decodes, so releasing it waits for the running batch and empties
the allocator cache; "cuda_graph" is accepted and tracked (there are no graphs here). While released,
generate raises. Resuming a tag that is not released raises MemoryStateError, as SGLang refuses it.

Concurrency: one batch decodes at a time; weight updates wait for it to finish unless generation is
paused (pause("in_place") / pause("retract")), in which case they load between two decode steps. After a
"retract" pause the running rows are re-prefilled (prompt + tokens so far) under the new weights;
after "in_place" they keep their KV cache. pause("abort") ends running and waiting rows with
finish reason "abort".
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

import torch

from megaopd.rollout.protocol import (FinishReason, Sample, SamplingParams, check_resume, expand_samples,
                                      memory_tags)
from megaopd.engine.sampling import row_generator, sample_tokens

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass
class EmbeddedEngineConfig:
    """How to build and run the embedded engine."""

    hf_dir: str
    """HF model directory (config.json + safetensors), e.g. the student's initial checkpoint."""
    device: str = "auto"
    """"auto" (cuda when present, else cpu), "cpu", or a torch device string such as "cuda:1"."""
    dtype: str = "float32"
    """Compute dtype of the model: float32 | bfloat16 | float16 | float64. Use float32 on CPU."""
    max_batch_size: int = 64
    """Rows (sequences) decoded together; a larger request runs in consecutive chunks."""
    release_weights: Literal["auto", "keep", "offload", "discard"] = "auto"
    """What release_memory does to the weights (see the module docstring); auto = offload on GPU, keep on CPU."""
    attn_implementation: str = "sdpa"
    """transformers attention backend ("sdpa" or "eager")."""
    load_tokenizer: bool = True
    """Load the HF dir's tokenizer when it has one (only used to fill the "text" field of responses)."""
    eos_token_ids: list[int] | None = None
    """Ids that end a response; None reads config.json and generation_config.json (their union)."""

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.hf_dir, "config.json")):
            raise ValueError(f"hf_dir={self.hf_dir!r} has no config.json; point it at an HF model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(_DTYPES)}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be at least 1")
        if self.release_weights not in ("auto", "keep", "offload", "discard"):
            raise ValueError(f"release_weights={self.release_weights!r}; choose auto, keep, offload or discard")


@dataclass
class RowRequest:
    """One sequence to generate: a prompt and its own sampling settings (one of a prompt's n samples)."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    """Ids that finish the row: EOS and stop_token_ids, none with ignore_eos (the caller builds this set)."""
    seed: int | None = None
    """Seed of this row's generator; None draws a fresh random seed."""

    @classmethod
    def from_params(cls, prompt_ids: list[int], params: SamplingParams, eos_ids: Iterable[int],
                    seed: int | None) -> "RowRequest":
        # SGLang 0.5.23: ignore_eos ignores stop_token_ids too (the response runs to its budget).
        stop = set() if params.ignore_eos else set(params.stop_token_ids) | set(eos_ids)
        return cls(prompt_ids=list(prompt_ids), max_new_tokens=params.max_new_tokens,
                   temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                   min_p=params.min_p, stop_ids=frozenset(stop), seed=seed)


@dataclass
class RowResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    matched: int | None = None
    """The stop id that ended the row (finish_reason "stop")."""
    weight_version: str | None = None


@dataclass(frozen=True)
class WeightSlot:
    """Where one HF-named tensor lives in the model: a module tensor, or a slice of a fused one."""

    param: str
    """The model's state_dict name."""
    index: tuple | None = None
    """Index into that tensor (None: the whole tensor)."""

    @property
    def key(self) -> tuple:
        """Hashable identity of the slice (slices are not hashable before Python 3.12)."""
        if self.index is None:
            return ()
        return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in self.index)


_FUSED_GATE_UP, _FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"


def fused_expert_slots(params: dict[str, torch.Tensor]) -> dict[str, WeightSlot]:
    """HF name -> WeightSlot for every loadable tensor of a transformers model.

    transformers 5 keeps a MoE layer's experts fused (Qwen3-MoE: `mlp.experts.gate_up_proj` [E, 2F, H],
    whose expert e is [gate_proj (F rows); up_proj (F rows)], as Qwen3MoeExperts.forward chunks it, and
    `mlp.experts.down_proj` [E, H, F]), while checkpoints, SGLang and megaopd's weight sync name each
    expert: `mlp.experts.{e}.gate_proj.weight` [F, H], `up_proj.weight` [F, H], `down_proj.weight` [H, F].
    Those per-expert names map to slices of the fused tensors; every other name maps to itself.
    """
    slots: dict[str, WeightSlot] = {}
    for name, t in params.items():
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            prefix, F = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                slots[f"{prefix}{e}.gate_proj.weight"] = WeightSlot(name, (e, slice(0, F)))
                slots[f"{prefix}{e}.up_proj.weight"] = WeightSlot(name, (e, slice(F, 2 * F)))
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                slots[f"{prefix}{e}.down_proj.weight"] = WeightSlot(name, (e,))
        else:
            slots[name] = WeightSlot(name)
    return slots


@dataclass
class PromptScores:
    """EmbeddedEngine.prompt_scores, temperature 1: about the prompt's tokens from `first` on."""

    logprobs: list[float]
    """Entry j: log p(token first + j | tokens before it); len(prompt) - first entries."""
    top_ids: list[list[int]] | None = None
    """Entry j: the top-k ids of the distribution that predicts token first + j, by decreasing probability;
    one entry more than logprobs: the last is the distribution after the prompt (the next token's)."""
    top_logprobs: list[list[float]] | None = None
    at_ids_logprobs: list[list[float]] | None = None
    """Log-probs at the caller's fixed ids (SGLang's token_ids_logprob), in their order; rows as top_ids."""


class WeightMismatchError(ValueError):
    """update_weights got names the model lacks or shapes that differ; nothing was loaded."""


class EngineReleasedError(RuntimeError):
    """generate was called while memory is released or weights are discarded and not yet reloaded."""


def read_eos_ids(hf_dir: str) -> list[int]:
    """EOS ids of an HF dir: config.json's eos_token_id plus generation_config.json's (int or list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            for v in (value if isinstance(value, list) else [value]):
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
    return ids


class EmbeddedEngine:
    """In-process engine over an HF causal LM; see the module docstring."""

    weight_transports = ("in_process",)
    """It loads HF-named tensors handed to update_weights in this process (megaopd.sync.in_process)."""

    def __init__(self, config: EmbeddedEngineConfig):
        from transformers import AutoModelForCausalLM

        self.config = config
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            config.hf_dir, dtype=self.dtype, attn_implementation=config.attn_implementation)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        # transformers 5.2x renamed forward's `past_key_values` to `cache` (the old name warns on every call
        # and goes in 5.40); older releases know only the old name.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos_ids = list(config.eos_token_ids) if config.eos_token_ids is not None else read_eos_ids(config.hf_dir)
        mc = self.model.config
        self.vocab_size = int(mc.vocab_size)
        self.pad_id = int(mc.pad_token_id) if getattr(mc, "pad_token_id", None) is not None else (self.eos_ids or [0])[0]
        self.tokenizer = None
        if config.load_tokenizer:
            self.tokenizer = _try_load_tokenizer(config.hf_dir)
        self.release_weights = config.release_weights
        if self.release_weights == "auto":
            self.release_weights = "offload" if self.device.type == "cuda" else "keep"
        self.weight_version = "default"
        # One condition guards the model: a decoding chunk holds it (releasing it only while paused),
        # weight loads and memory release take it.
        self._cond = threading.Condition(threading.Lock())
        self._paused = False
        self._pause_mode = "in_place"
        self._abort_epoch = 0
        self._waiting_updates = 0  # weight loads queued: new chunks wait so loads are not starved
        self._released: set[str] = set()  # memory tags released and not resumed since
        self._stale: set[str] = set()  # parameters discarded and not yet reloaded
        self._discarded_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._params = self.model.state_dict(keep_vars=True)  # module name -> Parameter/buffer (tied names alias)
        # The names update_weights speaks (the HF checkpoint's, as SGLang and megaopd's gather send them):
        # the module names, except that fused expert tensors are addressed per expert (fused_expert_slots).
        self._slots = fused_expert_slots(self._params)
        self._specs = {n: (tuple(self._view(n).shape), self._view(n).dtype) for n in self._slots}
        first: dict[tuple[int, tuple], str] = {}
        self._canonical = {n: first.setdefault((id(self._params[s.param]), s.key), n)
                           for n, s in self._slots.items()}  # alias -> one name
        self.running = 0  # rows currently decoding, for /get_server_info style reporting

    # ----------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt_index: int = 0) -> list[Sample]:
        rows = [RowRequest.from_params(r.prompt_ids, params, self.eos_ids, r.seed)
                for r in expand_samples(prompts, params.n, params.seed, first_prompt_index)]
        results = self.run(rows)
        return [Sample(prompt_ids=list(r.prompt_ids), output_ids=o.output_ids, output_logprobs=o.logprobs,
                       finish_reason=o.finish_reason, weight_version=o.weight_version)
                for r, o in zip(rows, results)]

    def run(self, rows: list[RowRequest], epoch: int | None = None) -> list[RowResult]:
        """Generates every row (in chunks of max_batch_size); results in row order.

        epoch: the abort epoch the rows were submitted in (a server queues them); rows submitted before
        an abort (pause("abort") / abort_all) finish "abort". Default: now.
        """
        for r in rows:
            self.check_row(r)
        results: list[RowResult] = []
        epoch = self._abort_epoch if epoch is None else epoch
        for start in range(0, len(rows), self.config.max_batch_size):
            chunk = rows[start:start + self.config.max_batch_size]
            with self._cond:
                while self._paused or self._waiting_updates:
                    if self._abort_epoch != epoch:
                        break
                    self._cond.wait(timeout=0.5)
                if self._abort_epoch != epoch:
                    results.extend(RowResult(finish_reason="abort", weight_version=self.weight_version)
                                   for _ in chunk)
                    continue
                if self._kv_released or self._weights_released or self._stale:
                    raise EngineReleasedError(self._released_message())
                self.running += len(chunk)
                try:
                    results.extend(self._decode_chunk(chunk, epoch))
                finally:
                    self.running -= len(chunk)
                    self._cond.notify_all()
        return results

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
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds "
                             f"the model's context of {limit} tokens")

    def _prefill(self, seqs: list[list[int]]):
        """Left-pads and runs the sequences; returns (cache, last logits [S, V], mask [S, L], next positions [S])."""
        from transformers import DynamicCache

        L = max(len(s) for s in seqs)
        ids_SL = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask_SL = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids_SL[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
            mask_SL[i, L - len(s):] = 1
        ids_SL, mask_SL = ids_SL.to(self.device), mask_SL.to(self.device)
        # Positions count real tokens only, so a left-padded prompt sees the same RoPE phases as unpadded.
        pos_SL = (mask_SL.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids_SL, attention_mask=mask_SL, position_ids=pos_SL, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        return cache, out.logits[:, -1, :].float(), mask_SL, pos_SL[:, -1] + 1

    @torch.inference_mode()
    def _decode_chunk(self, rows: list[RowRequest], epoch: int) -> list[RowResult]:
        B = len(rows)
        results = [RowResult(weight_version=self.weight_version) for _ in rows]
        gens = [row_generator(r.seed if r.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
                for r in rows]
        # Prefill each distinct prompt once, then repeat its cache rows for its samples.
        unique: dict[tuple[int, ...], int] = {}
        row_to_u = [unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in rows]
        cache, logits_UV, mask_UL, next_pos_U = self._prefill([list(p) for p in unique])
        idx_B = torch.tensor(row_to_u, device=self.device)
        cache.batch_select_indices(idx_B)
        logits_BV, mask_BL, next_pos_B = logits_UV[idx_B], mask_UL[idx_B], next_pos_U[idx_B]

        active = list(range(B))  # original row index of each batch position
        temp_B = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=self.device)
        top_p_B = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=self.device)
        top_k_B = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=self.device)
        min_p_B = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=self.device)
        while True:
            a_idx = torch.tensor(active, device=self.device)
            ids_A, lps_A = sample_tokens(logits_BV, temp_B[a_idx], top_p_B[a_idx], top_k_B[a_idx],
                                         [gens[i] for i in active], min_p_B[a_idx])
            keep: list[int] = []  # batch positions still running
            for pos, (row, tok, lp) in enumerate(zip(active, ids_A.tolist(), lps_A.tolist())):
                res, req = results[row], rows[row]
                res.output_ids.append(tok)
                res.logprobs.append(lp)
                if tok in req.stop_ids:
                    res.finish_reason, res.matched = "stop", tok
                elif len(res.output_ids) >= req.max_new_tokens:
                    res.finish_reason = "length"
                else:
                    keep.append(pos)
            if not keep:
                break
            new_tokens_A = ids_A
            if len(keep) < len(active):
                k_idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(k_idx)
                mask_BL, next_pos_B, new_tokens_A = mask_BL[k_idx], next_pos_B[k_idx], ids_A[k_idx]
                active = [active[p] for p in keep]
            # Step boundary: the only place a pause, an abort or a weight load can intervene.
            retract = False
            while self._paused and self._abort_epoch == epoch:
                retract |= self._pause_mode == "retract"
                self._cond.wait(timeout=0.5)
            if self._abort_epoch != epoch or self._kv_released or self._weights_released:
                # Aborted, or memory was released while paused: the running rows cannot continue.
                for row in active:
                    results[row].finish_reason = "abort"
                break
            if retract:
                # Recompute the KV cache of every running row under the (possibly new) weights.
                seqs = [rows[row].prompt_ids + results[row].output_ids for row in active]
                cache, logits_BV, mask_BL, next_pos_B = self._prefill(seqs)
            else:
                mask_BL = torch.cat([mask_BL, torch.ones_like(mask_BL[:, :1])], dim=1)
                out = self.model(input_ids=new_tokens_A.unsqueeze(-1), attention_mask=mask_BL,
                                 position_ids=next_pos_B.unsqueeze(-1), use_cache=True, **{self._cache_kw: cache})
                logits_BV = out.logits[:, -1, :].float()  # the cache object is updated in place
                next_pos_B = next_pos_B + 1
        return results

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """log softmax(logits) (temperature 1, as SGLang's input_token_logprobs) of each prompt token
        given its prefix; the first token has none."""
        return [None] + self.prompt_scores(prompt_ids).logprobs

    @torch.inference_mode()
    def prompt_scores(self, prompt_ids: list[int], top_k: int = 0, at_ids: list[int] | None = None,
                      first: int = 1) -> PromptScores:
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
        lp_RV = torch.log_softmax(logits_LV[first - 1:], dim=-1)  # rows predict tokens first..L-1, then the next
        out = PromptScores(logprobs=lp_RV[:-1].gather(-1, ids[0, first:].unsqueeze(-1)).squeeze(-1).tolist())
        if top_k:
            vals, idx = lp_RV.topk(min(top_k, lp_RV.shape[-1]), dim=-1)
            out.top_logprobs, out.top_ids = vals.tolist(), idx.tolist()
        if at_ids:
            out.at_ids_logprobs = lp_RV[:, torch.tensor(at_ids, device=lp_RV.device)].tolist()
        return out

    @property
    def abort_epoch(self) -> int:
        """Incremented by every abort; pass the value seen at submission to run(epoch=...)."""
        return self._abort_epoch

    # ------------------------------------------------------------------------------- control plane
    def pause(self, mode: str = "in_place") -> None:
        """Stops decoding at the next step boundary. mode: in_place | retract | abort (see module docstring)."""
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause mode {mode!r}; choose abort, retract or in_place")
        self._pause_mode = mode
        self._paused = True
        if mode == "abort":
            self._abort_epoch += 1
        self._notify()

    def continue_generation(self) -> None:
        self._paused = False
        self._notify()

    def abort_all(self) -> None:
        """Ends running and waiting rows with finish reason "abort" (without pausing)."""
        self._abort_epoch += 1
        self._notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def _notify(self) -> None:
        # Flags are plain attributes read by the decoding thread at step boundaries. Wake a paused chunk
        # at once if the condition is free; a chunk that is computing holds it and sees the flag at its
        # next boundary anyway, so never block here.
        if self._cond.acquire(timeout=0.0):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()

    def flush_cache(self) -> bool:
        """No cache outlives a batch here (no prefix cache); returns False while rows are decoding, like SGLang."""
        return self.running == 0

    def health(self) -> bool:
        return not (self._kv_released or self._weights_released)

    def weight_targets(self) -> list["EmbeddedEngine"]:
        return [self]

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
        return (f"{len(names)} weights were discarded by release_memory and not reloaded "
                f"(e.g. {names[:4]}); call update_weights with all of them before generating")

    # -------------------------------------------------------------------------------- weights
    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of every loadable tensor (tied aliases included)."""
        return dict(self._specs)

    def _view(self, name: str) -> torch.Tensor:
        """The model tensor (or the slice of a fused expert tensor) that HF name `name` loads into, resolved
        now: offload and discard replace the parameters' storage, so views are never kept."""
        slot = self._slots[name]
        t = self._params[slot.param]
        return t[slot.index] if slot.index is not None else t

    def check_weights(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Problems (unknown names, shape mismatches, duplicates) that would stop a load; [] when fine."""
        specs = self.param_specs()
        problems, seen = [], set()
        for name, shape in named_shapes:
            shape = tuple(int(s) for s in shape)
            if name in seen:
                problems.append(f"{name}: sent twice")
            seen.add(name)
            if name not in specs:
                problems.append(f"{name}: no such weight in the model")
            elif specs[name][0] != shape:
                problems.append(f"{name}: shape {list(shape)} != model's {list(specs[name][0])}")
        return problems

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """Loads full HF-named tensors (any subset of the model's weights) by name; all or nothing.

        Raises WeightMismatchError listing every unknown name and shape mismatch; then nothing is loaded.
        Waits for a running batch unless generation is paused.
        """
        named = [(n, t) for n, t in named_tensors]
        self._raise_on_mismatch([(n, tuple(t.shape)) for n, t in named])
        with self._exclusive():
            with torch.no_grad():
                for name, tensor in named:
                    target = self._view(name)
                    target.copy_(tensor.to(device=target.device))
            self._loaded([n for n, _ in named], weight_version)

    def receive_weights_in_place(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                                 fill: Callable[[list[torch.Tensor]], None], weight_version: str | None = None) -> bool:
        """Zero-copy load: fill(targets) writes straight into the model's tensors (e.g. a broadcast).

        Only when every (name, shape) matches and each dtype equals the model's (else returns False and
        does nothing, so the caller receives into scratch tensors and calls update_weights). Holds the
        model for the duration of fill, as a load does; a fill that fails half-way leaves those weights
        half-updated (as SGLang warns for its own loads).
        """
        if self.check_weights([(n, shape) for n, shape, _ in specs]):
            return False
        targets = [self._view(n) for n, _, _ in specs]
        if any(t.dtype != dt or not t.is_contiguous() for t, (_, _, dt) in zip(targets, specs)):
            return False
        with self._exclusive():
            with torch.no_grad():
                fill(targets)
            self._loaded([n for n, _, _ in specs], weight_version)
        return True

    def _raise_on_mismatch(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        problems = self.check_weights(named_shapes)
        if problems:
            raise WeightMismatchError(
                f"update_weights: {len(problems)} of {len(named_shapes)} tensors do not match the model "
                f"({len(self._slots)} weights, HF names such as {next(iter(self._slots))!r}); nothing was "
                "loaded:\n  " + "\n  ".join(problems))

    @contextlib.contextmanager
    def _exclusive(self):
        """The model, for a weight load: after the running chunk (or at its pause), before queued chunks."""
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
            self._stale.discard(self._canonical[name])
        if weight_version is not None:
            self.weight_version = str(weight_version)

    # -------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Frees the KV cache and, per `release_weights`, the weights; tags among MEMORY_TAGS (None = all).
        Releasing a released tag again does nothing."""
        tags = memory_tags(None if tags is None else list(tags), "release_memory")
        with self._cond:
            if "weights" in tags and not self._weights_released:
                if self.release_weights == "offload":
                    self.model.to("cpu")
                elif self.release_weights == "discard":
                    seen: set[int] = set()
                    for name, t in self._params.items():
                        if id(t) not in seen:
                            seen.add(id(t))
                            self._discarded_shapes[name] = (t.shape, t.dtype)
                            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    self._stale = set(self._canonical.values())  # a fused tensor: until each expert is loaded
            self._released.update(tags)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Re-allocates what release_memory freed (discarded weights come back as zeros, still stale).
        MemoryStateError (nothing resumed) when a named tag is not released; None = every tag."""
        tags = check_resume(None if tags is None else list(tags), self._released, "resume_memory")
        with self._cond:
            if "weights" in tags and self._weights_released:
                if self.release_weights == "offload":
                    self.model.to(self.device)
                elif self.release_weights == "discard":
                    for name, (shape, dtype) in self._discarded_shapes.items():
                        self._params[name].data = torch.zeros(shape, dtype=dtype, device=self.device)
                    self._discarded_shapes.clear()
            self._released.difference_update(tags)

    def model_info(self) -> dict:
        return {"model_path": self.config.hf_dir, "tokenizer_path": self.config.hf_dir,
                "is_generation": True, "weight_version": self.weight_version,
                "device": str(self.device), "dtype": self.config.dtype,
                "vocab_size": self.vocab_size, "eos_token_ids": self.eos_ids}

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
