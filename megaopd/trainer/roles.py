"""Builds the job's three Megatron models (student/actor, reference, teacher) and the rollout engine.

    actor = load_role_model(cfg.student, pgs_actor, trainable=True)
    teacher = load_role_model(cfg.teacher, pgs_teacher, trainable=False)

A role's path is an HF directory (loaded through the one HF <-> Megatron mapping) or a megaopd Megatron
checkpoint (dist_checkpointing, any saved layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megaopd.config.model import ModelConfig
from megaopd.data.vocab import VocabReport, compare_vocab
from megaopd.models.builder import StageInfo, build_gpt_model
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
    model = build_gpt_model(hf, section.tp, section.pp, pg_collection=pgs, dtype=section.dtype, init_weights=False)
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


def check_same_tokenizer(student, teacher, student_path: str, teacher_path: str,
                         stop_ids: Sequence[int] = ()) -> VocabReport:
    """OPD scores the student's tokens with the teacher: both must map text to the same ids. Special tokens
    may differ in name (the paper's pairs do); see megaopd.data.vocab.compare_vocab, which this calls.
    Returns its VocabReport (log report.log_lines(); add report.mask_ids to the loss's masked ids);
    raises VocabMismatchError (a ValueError) naming tokens when the regular vocabularies differ."""
    return compare_vocab(student, teacher, student_path, teacher_path, stop_ids=stop_ids)
