"""Builds the job's Megatron models: the student (actor, trained), the reference and the teacher.

    models = build_models(cfg, needs)          # every rank; each model in its own layout
    actor = load_role_model(cfg.student, pgs_actor, trainable=True)

A role's path is an HF directory (loaded through the one HF <-> Megatron mapping) or a megaopd Megatron
checkpoint (dist_checkpointing, any saved layout).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd.batching.owners import WorldLayout
from megaopd.data.alignment import alignment_report
from megaopd.data.teacher_view import TeacherPrompt
from megaopd.data.vocab import VocabMismatchError, VocabReport, compare_vocab
from megaopd.losses import LossNeeds
from megaopd.models.builder import (
    BuildOptions,
    StageInfo,
    activation_memory_overrides,
    apply_student_lora,
    build_gpt_model,
)
from megaopd.models.checkpoint import is_megatron_checkpoint, load_model_checkpoint, saved_lora
from megaopd.models.config import ModelConfig
from megaopd.models.hf_config import HFModelConfig, read_hf_config
from megaopd.models.hf_io import HFWeights
from megaopd.models.lora import BaseView
from megaopd.models.weights import Placement, load_hf_weights
from megaopd.parallel.dist import device
from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
from megaopd.scoring import PipelineRunner
from megaopd.scoring.passes import scorer_layout
from megaopd.scoring.remote import RemoteTeacher, ServerPolicy
from megaopd.scoring.teachers import InJobTeacher, TeacherSet

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig


@dataclass
class RoleModel:
    """One model of the job on this rank: its stage, its groups and its HF architecture."""

    model: torch.nn.Module
    pgs: ProcessGroupCollection
    hf: HFModelConfig
    path: str


def load_role_model(
    section: ModelConfig, pgs: ProcessGroupCollection, trainable: bool, path: str | None = None, seed: int = 0
) -> RoleModel:
    """A role's model on this rank, its weights loaded; a trained student with student.lora on gets its adapters
    (the base frozen: only the adapters reach DDP and the optimizer, which take trainable parameters only)."""
    path = path or section.path
    hf = read_hf_config(path)
    memory = activation_memory_overrides(section.recompute, section.recompute_num_layers, section.sequence_parallel)
    lora = getattr(section, "lora", None) if trainable else None
    lora = lora if lora is not None and lora.enabled else None
    # A LoRA checkpoint (metadata 'lora') holds base + adapters: they are rebuilt before it loads (or refused).
    saved = saved_lora(path, "student" if trainable else "model", lora, trainable)
    lora = saved or lora
    # A trained MoE router gets the HF config's load-balancing loss; a frozen one none. LoRA wraps megatron's
    # local linears only (models/lora.py: TE's fused norm + linear has another input).
    model = build_gpt_model(
        hf,
        Layout(tp=section.tp, pp=section.pp, ep=section.ep),
        pgs,
        BuildOptions(
            dtype=section.dtype,
            init_weights=False,
            train_router=trainable,
            config_overrides=memory,
            use_te=False if lora is not None else None,
        ),
    )
    if saved is not None:
        apply_student_lora(model, hf, saved, pgs, seed)
    if is_megatron_checkpoint(path):
        load_model_checkpoint(model, path, pgs)
    else:
        st = StageInfo.of(pgs)
        ep_rank = pgs.ep.rank() if section.ep > 1 else 0
        place = Placement(
            tp_rank=st.tp_rank,
            tp_size=section.tp,
            pp_rank=st.pp_rank,
            pp_size=section.pp,
            ep_rank=ep_rank,
            ep_size=section.ep,
        )
        load_hf_weights(model, HFWeights(path), hf, place)
    if lora is not None and saved is None:  # on an HF base: the adapters start fresh (B = 0)
        apply_student_lora(model, hf, lora, pgs, seed)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return RoleModel(model, pgs, hf, path)


@dataclass
class Models:
    """This rank's stages of the job's models and the runners that drive them."""

    actor: RoleModel
    teacher: RoleModel | None
    """None for losses that do not read a teacher (sft, grpo): metrics then skip its parts."""
    partner: torch.nn.Module | None
    """The frozen model run in lockstep with the actor in training: the reference (ref_kl) or, for gkd,
    the teacher; None when the loss needs neither."""
    partner_offload: bool
    actor_runner: PipelineRunner
    """The actor alone (forward-only log pi_old); train_runner drives the DDP-wrapped actor + partner."""
    actor_layout: WorldLayout
    """The actor's scorer_layout (which replica each global rank scores for, and who speaks for it)."""
    owner_layout: WorldLayout
    """Which actor replica each global rank is in and whether it speaks for it (TP rank 0, PP rank 0): where
    every row's scores are owned (RowOwners.layout)."""
    teacher_runner: PipelineRunner | None
    teachers: TeacherSet | None = None
    """Every teacher of the job by name (in-job ones with their runners, served ones as RemoteTeacher) and
    the routing of samples to them; None when the loss reads no teacher."""


def build_models(
    cfg: MegaOPDConfig,
    needs: LossNeeds,
    stop: Callable[[], bool] | None = None,
    prompts: dict[str, TeacherPrompt] | None = None,
) -> Models:
    """Actor in the student layout (which also initializes megatron's global state), teacher in its own
    layout (the actor's groups when equal), and the lockstep partner. stop: served teachers give up their
    waits once it is true (the preemption flag). prompts: the teachers that read a sequence of their own
    (TeacherSet.prompts). A teacher that is the reference (teacher.path: reference, resolved to the
    reference's weights) in the student's layout shares the reference's model when the loss loads one."""
    student_layout = Layout(cfg.student.tp, cfg.student.pp, cfg.student.ep)
    layouts = [Layout(t.tp, t.pp, t.ep) for t in cfg.teachers]
    if needs.teacher_logits and (layouts != [student_layout] or needs.reference):
        raise ValueError(
            "gkd needs the teacher's full logits in the student's vocab sharding: set teacher.tp/pp "
            "equal to student.tp/pp, and do not combine gkd with ref_kl in one loss"
        )
    actor_pgs = initialize_actor_layout(student_layout, seed=cfg.trainer.seed)
    actor = load_role_model(cfg.student, actor_pgs, trainable=True, seed=cfg.trainer.seed)
    # In-job teachers, each in its own layout (groups shared between equal layouts); served ones are HTTP.
    groups = {student_layout: actor_pgs}
    in_job: dict[str, RoleModel] = {}
    reference = None
    free_reference = needs.reference and cfg.reference_is_the_base()  # BaseView: adapters off, bit-exact
    if needs.reference and not free_reference:
        reference = load_role_model(
            cfg.student, actor_pgs, trainable=False, path=cfg.reference.path or cfg.student.path
        )
        _park(reference.model, cfg.reference.offload_between_uses)
    for t in cfg.teachers:
        if t.in_job:
            layout = Layout(t.tp, t.pp, t.ep)
            if layout not in groups:
                groups[layout] = build_process_groups(layout)
            if reference is not None and cfg.teacher_shares_reference(t):
                in_job[t.name] = reference  # the same frozen weights in the same layout: no second copy
                continue
            in_job[t.name] = load_role_model(t, groups[layout], trainable=False)
            _park(in_job[t.name].model, t.offload_between_uses)  # one model at a time on the GPU at start-up
    teacher = next(iter(in_job.values())) if len(in_job) == 1 else None  # gkd's partner (one teacher)
    partner, partner_offload = None, False
    if free_reference:  # the LoRA student's frozen base with its adapters off: no second copy
        partner = BaseView(actor.model)
    elif reference is not None:
        partner, partner_offload = reference.model, cfg.reference.offload_between_uses
    elif needs.teacher_logits:
        partner, partner_offload = teacher.model, cfg.teachers[0].offload_between_uses
    vocab_size = actor.hf.vocab_size
    # Teacher ids past the student's vocabulary (a bigger padded embedding of the same tokenizer) are
    # masked, so its top-K never proposes a token the student cannot produce.
    chunk = cfg.trainer.logits_chunk_tokens  # the fused output layer in every pass (0: whole logits)
    # A cross-tokenizer teacher scores its own ids over its whole vocabulary.
    cross = {n for n, p in (prompts or {}).items() if p.cross}
    runners = {
        n: PipelineRunner(
            m.model,
            m.pgs,
            m.hf.vocab_size if n in cross else min(m.hf.vocab_size, vocab_size),
            logits_chunk_tokens=chunk,
        )
        for n, m in in_job.items()
    }
    # Where each global rank sits in every model's layout: fixed for the run, so gathered once here, not by
    # every step's passes (collectives in the same order on every rank: owners, actor, in-job teachers).
    owner_layout = WorldLayout.gather(
        actor_pgs.dp.rank(), actor_pgs.tp.rank() == 0 and actor_pgs.pp.rank() == 0, device()
    )
    actor_layout = scorer_layout(actor_pgs, device())
    members = []
    for t in cfg.teachers:
        if t.in_job:
            m = in_job[t.name]
            members.append(
                InJobTeacher(
                    t.name, runners[t.name], m.model, t.offload_between_uses, layout=scorer_layout(m.pgs, device())
                )
            )
        else:
            members.append(
                RemoteTeacher(
                    t.name,
                    t.urls,
                    ServerPolicy(
                        rows_per_request=t.rows_per_request,
                        timeout_s=t.request_timeout_s,
                        retries=t.retries,
                        stall_timeout_s=cfg.rollout.stall_timeout_s,
                        api_key_env=t.api_key_env,
                    ),
                    stop=stop,
                )
            )
    teacher_runner = runners[next(iter(in_job))] if teacher is not None else None
    return Models(
        actor,
        teacher,
        partner,
        partner_offload,
        PipelineRunner(actor.model, actor_pgs, vocab_size, logits_chunk_tokens=chunk),
        actor_layout,
        owner_layout,
        teacher_runner,
        TeacherSet(members, prompts) if members else None,
    )


def _park(model: torch.nn.Module, offload: bool) -> None:
    """An offloaded frozen model waits in CPU memory for its first use (on_gpu_while_used)."""
    if offload and torch.cuda.is_available():
        model.cpu()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def on_gpu_while_used(model: torch.nn.Module | None, offload: bool):
    """With offload (GPU only), the frozen model lives in CPU memory except inside this block, leaving
    its GPU memory to the actor's activations and optimizer state."""
    if model is None or not offload or not torch.cuda.is_available():
        yield
        return
    model.cuda()
    try:
        yield
    finally:
        model.cpu()
        torch.cuda.empty_cache()


def check_same_tokenizer(
    student, teacher, student_path: str, teacher_path: str, stop_ids: Sequence[int] = ()
) -> VocabReport:
    """OPD scores the student's tokens with the teacher: both must map text to the same ids. Special tokens
    may differ in name (the paper's pairs do); see megaopd.data.vocab.compare_vocab, which this calls.
    Returns its VocabReport (log report.log_lines(); add report.mask_ids to the loss's masked ids);
    raises VocabMismatchError (a ValueError) naming tokens when the regular vocabularies differ."""
    return compare_vocab(student, teacher, student_path, teacher_path, stop_ids=stop_ids)


def check_teacher_tokenizers(
    student, student_path: str, teachers, tokenizers, stop_ids, log, cross: set[str] | None = None
) -> VocabReport | None:
    """Every teacher must share the student's regular vocabulary (special tokens may be named differently),
    except one with teacher.tokenizer=own, which is then a cross-tokenizer teacher: its name goes into `cross`
    and the log says so and why. Logs what each report found. Returns the first same-vocabulary teacher's
    report, whose special-token pairs mask the loss."""
    first = None
    for t, t_tok in zip(teachers, tokenizers):
        say = (lambda line: log(line)) if len(teachers) == 1 else (lambda line, n=t.name: log(f"[teacher {n}] {line}"))
        try:
            report = check_same_tokenizer(student, t_tok, student_path, t.path, stop_ids=stop_ids)
        except VocabMismatchError as e:
            if t.tokenizer != "own":
                raise VocabMismatchError(
                    f"{e} (a teacher with another tokenizer: set teacher.tokenizer=own, and a loss that reads the "
                    f"teacher at the sampled tokens: opd or stable_opd)"
                ) from None
            if cross is not None:
                cross.add(t.name)
            say(
                f"[vocab] cross-tokenizer mode: teacher {t.path}'s tokenizer maps text to other ids than the "
                f"student's and teacher.tokenizer=own, so it reads each response re-tokenized in its own tokens and "
                f"its log-probs are summed over aligned text spans (docs/algorithms.md)"
            )
            for line in alignment_report(student, t_tok):
                say(line)
            continue
        first = first or report
        for line in report.log_lines():
            say(line)
    return first
