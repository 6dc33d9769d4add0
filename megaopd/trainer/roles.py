"""Builds the job's three Megatron models (student/actor, reference, teacher) and the rollout engine.

    actor = load_role_model(cfg.student, pgs_actor, trainable=True)
    teacher = load_role_model(cfg.teacher, pgs_teacher, trainable=False)

A role's path is an HF directory (loaded through the one HF <-> Megatron mapping) or a megaopd Megatron
checkpoint (dist_checkpointing, any saved layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd.config.model import ModelConfig
from megaopd.models.builder import StageInfo, activation_memory_overrides, build_gpt_model
from megaopd.models.checkpoint import is_megatron_checkpoint, load_model_checkpoint
from megaopd.models.hf_config import HFModelConfig, read_hf_config
from megaopd.models.hf_io import HFWeights
from megaopd.models.weights import load_hf_weights


@dataclass
class RoleModel:
    """One model of the job on this rank: its stage, its groups and its HF architecture."""

    model: torch.nn.Module
    pgs: ProcessGroupCollection
    hf: HFModelConfig
    path: str


def load_role_model(section: ModelConfig, pgs: ProcessGroupCollection, trainable: bool,
                    path: str | None = None) -> RoleModel:
    path = path or section.path
    hf = read_hf_config(path)
    memory = activation_memory_overrides(section.recompute, section.recompute_num_layers, section.sequence_parallel)
    model = build_gpt_model(hf, section.tp, section.pp, pg_collection=pgs, dtype=section.dtype, init_weights=False,
                            config_overrides=memory)
    if torch.cuda.is_available():
        model.cuda()
    if is_megatron_checkpoint(path):
        load_model_checkpoint(model, path, pgs)
    else:
        st = StageInfo.of(pgs)
        load_hf_weights(model, HFWeights(path), hf, st.tp_rank, section.tp, st.pp_rank, section.pp)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return RoleModel(model, pgs, hf, path)


def check_same_tokenizer(student, teacher, student_path: str, teacher_path: str) -> None:
    """OPD scores the student's tokens with the teacher: both must map text to the same ids."""
    problems = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:5]
        only_t = sorted(set(tv) - set(sv))[:5]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:5]
        problems.append(f"token-to-id maps differ (only in student: {only_s}, only in teacher: {only_t}, "
                        f"different ids: {moved})")
    if student.eos_token_id != teacher.eos_token_id:
        problems.append(f"EOS differs (student {student.eos_token!r}={student.eos_token_id}, teacher "
                        f"{teacher.eos_token!r}={teacher.eos_token_id})")
    s_special = sorted(str(t) for t in student.all_special_tokens)
    t_special = sorted(str(t) for t in teacher.all_special_tokens)
    if s_special != t_special:
        problems.append(f"special tokens differ (student {s_special}, teacher {t_special})")
    if problems:
        raise ValueError(f"teacher tokenizer ({teacher_path}) does not match the student's ({student_path}): "
                         f"{'; '.join(problems)}. OPD needs one tokenizer: pick a teacher of the student's family")
