"""`megaopd plan CONFIG --step-time`: a step's seconds in each rollout.mode on 1, 2, 4, ... nodes, from the
config's work and stated rates, before any GPU hour is spent choosing a mode.

The work of one step (from the config; lengths from plan.step_time where the data decides them):
    R = prompts x samples rows of P prompt tokens and responses of mean L, the longest L_max the rollout's
    budget after the prompt (max_new_tokens; a multi-turn trajectory's max_trajectory_tokens: a batch of
    hundreds of responses with a truncation rate above zero has one at the budget), plus the golden rows of
    the losses that train on them.

Phases (docs/algorithms.md 1.12, "Choosing a mode"):
    generate  an engine instance of tp_e GPUs decodes its b = R / instances rows; every decode step reads
              the weights W once (or, at a large batch, computes 2N per row: the larger of the two), and
              each active row's KV cache; the last step waits for the longest response:
                  t = max(L_max * W, b * L * 2N * bw / flops) / bw + b * kv * (P*L + L^2/2) / bw + prefill
              bw = hbm_tb_s x tp_e x decode_efficiency; flops = peak_tflops x tp_e x score_mfu
    score     the actor's log pi_old and an in-job teacher's log q: forward FLOPs / (GPUs x peak x score_mfu)
    train     the step's model FLOPs (6N per trained token, attention included; megaopd.metrics.flops) /
              (GPUs x peak x train_mfu): train_mfu is model-FLOPs MFU, the trainer's perf/ metric, so
              recomputation and the lockstep reference are inside it
    sync      the student's bf16 weights / the link: local_gb_s colocated or within a node, network_gb_s to
              engines on other nodes

Modes (predict): sync chains the phases; one_step_off and async overlap generation with scoring and
training, which needs engines on GPUs of their own (colocated engines stay sync): of N x gpus_per_node
GPUs, E generate and the rest train, E chosen per mode for the shortest step. A served teacher scores on
its own nodes (not counted here). Estimates, not measurements: each rate's docstring says where its
default comes from; replace them with your cluster's (`plan.step_time.train_mfu=...`) or with the phase
times of a first run's metrics.jsonl (time/rollout, time/actor_logprobs + time/teacher + time/train,
time/sync) through predict().
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaopd.config.plan_config import StepTimeConfig
from megaopd.config.schema import MegaOPDConfig
from megaopd.data.teacher_view import context_fields
from megaopd.metrics.flops import MatmulDims, StepWork, step_flops

MODES = ("sync", "one_step_off", "async")


@dataclass(frozen=True)
class StepShape:
    """One step's work as the prediction sees it."""

    rows: int
    prompt_tokens: int
    response_tokens: int
    """Mean response length (and golden solutions')."""
    longest: int
    """The longest response: the decode steps the batch waits for."""
    golden_rows: int
    student: MatmulDims
    teacher: MatmulDims | None
    """An in-job teacher (a served one scores on its own nodes)."""
    reference: MatmulDims | None
    weight_bytes: float
    """The engines' copy of the student (bf16, embedding included): read once per decode step, pushed per sync."""
    kv_bytes_per_token: float
    trainer_gpus_min: int
    """GPUs of one student replica (tp x pp): the trainer's smallest share."""
    teacher_context_tokens: int = 0
    """What the in-job teacher's own context adds to each of its rows (teacher.context with {golden}: a golden
    solution, as long as a response on average); 0: it scores the student's rows."""


def generate_s(w: StepShape, r: StepTimeConfig, gpus: int) -> float:
    """Seconds to generate the step's rows on `gpus` engine GPUs (module docstring)."""
    instances = max(gpus // r.engine_tp, 1)
    b = math.ceil(w.rows / instances)
    bw = r.hbm_tb_s * 1e12 * r.engine_tp * r.decode_efficiency
    flops = r.peak_tflops * 1e12 * r.engine_tp * r.score_mfu
    decode = max(w.longest * w.weight_bytes / bw, b * w.response_tokens * 2.0 * w.student.params / flops)
    kv = b * w.kv_bytes_per_token * (w.prompt_tokens * w.response_tokens + w.response_tokens**2 / 2) / bw
    prefill = b * w.student.forward([w.prompt_tokens]) / flops
    return decode + kv + prefill


def score_and_train_s(w: StepShape, r: StepTimeConfig, gpus: int) -> tuple[float, float]:
    """Seconds of the scoring passes and of the training phase on `gpus` trainer GPUs."""
    rollout_S = [w.prompt_tokens + w.response_tokens] * w.rows
    f = step_flops(
        StepWork(
            w.student,
            rollout_S + [w.prompt_tokens + w.response_tokens] * w.golden_rows,
            actor_scored_S=rollout_S,
            teacher=w.teacher,
            teacher_scored_S=[s + w.teacher_context_tokens for s in rollout_S] if w.teacher else (),
            partner=w.reference,
        )
    )  # the lockstep reference: hardware FLOPs, inside train_mfu
    rate = gpus * r.peak_tflops * 1e12
    return (f.model - f.model_train) / (rate * r.score_mfu), f.model_train / (rate * r.train_mfu)


def predict(mode: str, generate: float, rest: float, sync: float = 0.0) -> float:
    """Step time of `mode` from per-phase seconds (measured or estimated): generate the generation, rest the
    scoring, training and bookkeeping, sync the weight push. sync chains them; one_step_off and async
    overlap generation with the rest (engines on devices of their own), so the slower side sets the pace;
    async also hides the push behind in-flight generation."""
    if mode == "sync":
        return generate + rest + sync
    if mode == "one_step_off":
        return max(generate, rest) + sync
    if mode == "async":
        return max(generate, rest + sync)
    raise ValueError(f"unknown rollout.mode {mode!r}: choose one of {', '.join(MODES)}")


@dataclass(frozen=True)
class Choice:
    seconds: float
    engine_gpus: int
    """GPUs that generate (all of them, colocated)."""


def step_times(w: StepShape, r: StepTimeConfig, nodes: int) -> dict[str, Choice]:
    """Per layout: colocated sync on every GPU, and each mode with E engine GPUs of their own (the best E)."""
    g = nodes * r.gpus_per_node
    score, train = score_and_train_s(w, r, g)
    out = {"sync colocated": Choice(generate_s(w, r, g) + score + train + w.weight_bytes / (r.local_gb_s * 1e9), g)}
    # Engines on other GPUs of the same node take the push over the node's own links.
    push = w.weight_bytes / ((r.local_gb_s if nodes == 1 else r.network_gb_s) * 1e9)
    for e in range(r.engine_tp, g, r.engine_tp):
        if (g - e) % w.trainer_gpus_min:
            continue
        generate, rest = generate_s(w, r, e), sum(score_and_train_s(w, r, g - e))
        for mode in MODES:
            t, key = predict(mode, generate, rest, push), f"{mode} split"
            if key not in out or t < out[key].seconds:
                out[key] = Choice(t, e)
    return out


def shape_for(cfg: MegaOPDConfig) -> StepShape:
    """The StepShape of a loaded config (reads the models' config.json files)."""
    from megaopd.losses import build_loss_from
    from megaopd.models.config import find_hf_config
    from megaopd.models.hf_config import params_per_rank, read_hf_config

    r, needs = cfg.plan.step_time, build_loss_from(cfg.loss).needs
    hf = read_hf_config(find_hf_config(cfg.student.path))
    student = MatmulDims.of(hf)
    in_job = [t for t in cfg.teachers if t.in_job]
    teacher = MatmulDims.of(read_hf_config(find_hf_config(in_job[0].path))) if in_job else None
    # The longest response: the rollout's budget after the prompt (a multi-turn trajectory's, with an
    # environment), from the config's one row-length function.
    longest = cfg.rollout_row_tokens() - cfg.data.max_prompt_len
    response = r.response_tokens or longest // 2
    return StepShape(
        rows=cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt,
        prompt_tokens=r.prompt_tokens,
        response_tokens=response,
        longest=longest,
        golden_rows=cfg.trainer.prompts_per_step if needs.golden else 0,
        student=student,
        teacher=teacher,
        reference=student if needs.reference else None,
        # the whole model in bf16, every expert of a MoE layer (as the plan counts an engine's copy)
        weight_bytes=2.0 * params_per_rank(hf, 1, 1),
        kv_bytes_per_token=2.0 * 2 * hf.num_layers * hf.num_key_value_heads * hf.head_dim,
        trainer_gpus_min=cfg.student.tp * cfg.student.pp,
        teacher_context_tokens=response if in_job and "golden" in context_fields(in_job[0].context) else 0,
    )


def format_step_times(cfg: MegaOPDConfig) -> str:
    """The table `megaopd plan --step-time` prints: seconds per step and vs colocated sync, per node count."""
    w, r = shape_for(cfg), cfg.plan.step_time
    g1 = r.gpus_per_node
    score, train = score_and_train_s(w, r, g1)
    lines = [
        f"step time per rollout.mode (estimates: plan.step_time's rates; {w.rows} rows of {w.prompt_tokens} "
        f"prompt + {w.response_tokens} mean / {w.longest} longest response tokens, {w.golden_rows} golden rows)",
        f"one node ({g1} GPUs) alone: generate {generate_s(w, r, g1):.1f} s, score {score:.1f} s, "
        f"train {train:.1f} s, sync {w.weight_bytes / (r.local_gb_s * 1e9):.2f} s colocated / "
        f"{w.weight_bytes / (r.network_gb_s * 1e9):.2f} s to other nodes",
        "",
        "| nodes | GPUs | sync colocated | sync split | one_step_off | async |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in r.nodes:
        t = step_times(w, r, n)
        base = t["sync colocated"].seconds
        cells = [f"{base:.1f} s"]
        for key in ("sync split", "one_step_off split", "async split"):
            c = t.get(key)
            cells.append("-" if c is None else f"{c.seconds:.1f} s ({c.seconds / base:.2f}x; E={c.engine_gpus})")
        lines.append(f"| {n} | {n * g1} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "E: GPUs that generate, the rest train (the best split for that mode; its memory is not "
        "checked: plan the trainer at that size with run.world_size); x: vs sync colocated. A served "
        "teacher's scoring runs on its own nodes and is not counted.",
    ]
    return "\n".join(lines)
