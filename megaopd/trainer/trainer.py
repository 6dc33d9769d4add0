"""The OPD step loop (ARCHITECTURE.md "One training step"), for every algorithm of ALGORITHMS.md.

    prompts (+ golden solutions)  -> engines generate n responses each (rank 0; broadcast to all ranks)
    -> actor forward-only: log pi_old (+ its top-k and entropy for LSM-student and overlap metrics)
    -> teacher forward-only, its own TP/PP: log q of the sampled tokens (+ top-K, + at the student's top-k)
    -> rewards (math-verify) -> train: per mini-batch, micro-batches through megatron's schedule with the
       reference (or, for GKD, the teacher) in lockstep -> loss -> backward -> Adam step
    -> weight sync into the engines -> metrics -> validation every N -> checkpoint every M

Every rank holds the whole rollout batch (token ids and small per-token scores): that makes global
token counts local arithmetic and lets each layout take its own data-parallel rows.

    python -m megaopd.cli train examples/tiny/stable_opd.yaml run.dir=runs/tiny
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaopd.config.schema import MegaOPDConfig
from megaopd.data import PromptDataset, PromptLoader, golden_batch
from megaopd.losses import LossInputs, build_loss_from, mask_first_occurrences
from megaopd.losses.requirements import loss_requirements
from megaopd.metrics import (CollapseDetector, advantage_split, math_verify_rewards, repetitive_token_mask,
                             response_metrics, rollout_dynamics, topk_overlap)
from megaopd.parallel.dist import init_distributed
from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
from megaopd.rollout.protocol import SamplingParams
from megaopd.sync.gather import gather_hf_weights, model_state
from megaopd.trainer.batch import RolloutBatch, build_rollout_batch
from megaopd.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megaopd.trainer.optim import build_optimizer, wrap_for_training
from megaopd.trainer.preemption import PreemptionFlag
from megaopd.models.hf_io import load_tokenizer, tokenizer_dir
from megaopd.trainer.roles import check_same_tokenizer, load_role_model
from megaopd.trainer.run_log import RunLog
from megaopd.trainer.scoring import TokenScores, dp_rows, pad_rows, score_tokens
from megaopd.trainer.stage_runner import StageRunner


@dataclass
class MicroBatchData:
    """Everything step_fn needs for one micro-batch (rows: on-policy, then golden, then padding)."""

    tokens_BS: torch.Tensor
    loss_mask_BT: torch.Tensor
    golden_mask_BT: torch.Tensor
    extras: dict


@dataclass
class ScoredRollout:
    """A step's responses with the actor's and the teacher's per-token scores (every rank)."""

    batch: RolloutBatch
    old: TokenScores
    teacher: TokenScores | None
    student_support: torch.Tensor | None
    """The student's top-k ids per position (LSM student support), or None."""
    samples: list
    texts: list[str]


class Trainer:
    """One rank of an OPD job. Start-up order: inputs (tokenizers, data), models, resume, engine; each
    step fails early on bad input before anything expensive runs."""

    def __init__(self, cfg: MegaOPDConfig):
        init_distributed()
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.run_log: RunLog | None = None  # created once the run folder's state is known
        torch.manual_seed(cfg.trainer.seed)
        self.loss_fn = build_loss_from(cfg.loss)
        self.needs = loss_requirements(self.loss_fn)
        self.temperature = cfg.rollout.temperature
        self._load_inputs()
        self._load_models()
        self._resume()
        self._start_engine()

    def _load_inputs(self) -> None:
        """Tokenizers and data first: a bad file fails here, before any model is loaded."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.student.path)
        teacher_tokenizer = None
        if cfg.teacher.path:
            teacher_tokenizer = load_tokenizer(cfg.teacher.path)
            check_same_tokenizer(self.tokenizer, teacher_tokenizer, cfg.student.path, cfg.teacher.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.special_ids = [self.tokenizer.convert_tokens_to_ids(t) for t in cfg.loss.mask_first_tokens]
        dataset = PromptDataset.load(cfg.data, self.tokenizer,
                                     teacher_tokenizer if cfg.data.prompt_template == "teacher" else None,
                                     log=self._console if self.rank == 0 else None)
        # dp_size=1: every rank draws the same global batch (rank 0 generates it, every layout then
        # takes its own rows of the responses).
        self.loader = PromptLoader(dataset, cfg.data, batch_size=cfg.trainer.prompts_per_step)

    def _load_models(self) -> None:
        """Actor (+ DDP, optimizer), teacher in its own layout, and the partner run in lockstep with the
        actor: the reference (ref_kl) or, for gkd, the teacher."""
        cfg = self.cfg
        student_layout = Layout(cfg.student.tp, cfg.student.pp)
        teacher_layout = Layout(cfg.teacher.tp, cfg.teacher.pp)
        if self.needs.teacher_logits and (teacher_layout != student_layout or self.needs.reference):
            raise ValueError("gkd needs the teacher's full logits in the student's vocab sharding: set teacher.tp/pp "
                             "equal to student.tp/pp, and do not combine gkd with ref_kl in one loss")
        self.actor_pgs = initialize_actor_layout(student_layout, seed=cfg.trainer.seed)
        self.teacher_pgs = self.actor_pgs if teacher_layout == student_layout else build_process_groups(teacher_layout)
        self.actor = load_role_model(cfg.student, self.actor_pgs, trainable=True)
        self.vocab_size = self.actor.hf.vocab_size
        self.ddp = wrap_for_training(self.actor.model, self.actor_pgs, cfg.optimizer.use_distributed_optimizer)
        self.optimizer, self.scheduler = build_optimizer(
            self.ddp, cfg.optimizer, cfg.trainer.max_steps * cfg.trainer.mini_batches_per_step)
        # The teacher is optional for losses that do not read it (sft, grpo): metrics then skip its parts.
        self.teacher = load_role_model(cfg.teacher, self.teacher_pgs, trainable=False) if cfg.teacher.path else None
        self.partner, self.partner_offload = None, False
        if self.needs.reference:
            self.partner = load_role_model(cfg.student, self.actor_pgs, trainable=False,
                                           path=cfg.reference.path or cfg.student.path).model
            self.partner_offload = cfg.reference.offload_between_uses
        elif self.needs.teacher_logits:
            self.partner = self.teacher.model
            self.partner_offload = cfg.teacher.offload_between_uses
        for model, offload in ((self.teacher.model if self.teacher else None, cfg.teacher.offload_between_uses),
                               (self.partner, self.partner_offload)):
            if model is not None and offload and torch.cuda.is_available():
                model.cpu()  # parked until its first use (on_gpu_while_used)
        self.train_runner = StageRunner(self.ddp, self.actor_pgs, self.vocab_size, partner=self.partner)
        self.actor_runner = StageRunner(self.ddp, self.actor_pgs, self.vocab_size)
        # Teacher ids past the student's vocabulary (a bigger padded embedding of the same tokenizer) are
        # masked, so its top-K never proposes a token the student cannot produce.
        self.teacher_runner = (StageRunner(self.teacher.model, self.teacher_pgs,
                                           min(self.teacher.hf.vocab_size, self.vocab_size))
                               if self.teacher is not None else None)

    def _resume(self) -> None:
        """Step 0, or the state of the run folder's last complete checkpoint."""
        cfg = self.cfg
        self.step = 0
        self._last_metrics: dict = {}
        self.detector = CollapseDetector(cfg.metrics.collapse)
        self.preemption = PreemptionFlag()
        latest = latest_checkpoint(cfg.run.dir)
        if latest is not None:
            state = load_checkpoint(latest, self.actor.model, self.optimizer, self.actor_pgs)
            self.step = state["step"]
            self.scheduler.load_state_dict(state["scheduler"])
            self.loader.load_state_dict(state["data"])
            self.detector.load_state_dict(state["collapse"])
        if self.rank == 0:
            self.run_log = RunLog(cfg.run.dir, cfg.trainer.max_steps, cfg.logging.tensorboard,
                                  cfg.logging.progress_bar, start_step=self.step)
            if latest is not None:
                self.run_log.console(f"resumed from {latest} at step {self.step}")

    def _start_engine(self) -> None:
        """The rollout engine, holding the actor's current weights (checked by the parity probe). Rollouts
        and validation generate; an SFT run without validation needs no engine at all."""
        from megaopd.models.checkpoint import is_megatron_checkpoint

        cfg = self.cfg
        self.engine = None
        if not (self.needs.on_policy or cfg.validation.path):
            return
        if cfg.rollout.engine == "embedded" and is_megatron_checkpoint(cfg.student.path):
            self.export_hf(os.path.join(cfg.run.dir, "hf_init"))  # collective; the engine is built from it
        from megaopd.sync import WeightSync

        self.engine = self._build_engine()
        self.weight_sync = WeightSync(self.engine, cfg.rollout, self.rank)
        self.sync_weights()
        self._check_parity(tolerance=cfg.rollout.parity_tolerance)

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> dict:
        cfg = self.cfg.trainer
        summary = {"start_step": self.step}
        if self.step == 0 and cfg.eval_interval:
            summary["val_before"] = self._validate()
            if self.rank == 0 and summary["val_before"]:
                self.run_log.log_step(0, summary["val_before"])  # the "before" point of the figures
        step_times = []
        while self.step < cfg.max_steps:
            metrics = self.train_step()
            step_times.append(metrics["time/step"])
            if cfg.eval_interval and (self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps):
                metrics.update(self._validate())
            self._log(metrics)
            stop = self.preemption.should_stop()
            if stop or self.step % cfg.save_interval == 0 or self.step == cfg.max_steps:
                self.save()
            if stop:
                self._console(f"preemption signal received: checkpoint saved at step {self.step}, exiting")
                summary["preempted"] = True
                return summary
        self.export_hf(os.path.join(self.cfg.run.dir, "hf"))
        summary.update(self._last_metrics, step_time_mean=sum(step_times) / max(len(step_times), 1))
        return summary

    def train_step(self) -> dict:
        cfg, needs = self.cfg, self.needs
        t0 = time.time()
        examples = self.loader.next_batch()
        times = {}
        rollout = self._rollout_and_score(examples, times) if needs.on_policy else None
        golden = golden_batch(examples, self.pad_id) if needs.golden else None
        t_train = time.time()
        loss_metrics = self._train(rollout, golden)
        times["time/train"] = time.time() - t_train
        self.step += 1
        t_sync = time.time()
        if needs.on_policy:  # an SFT-only step generates nothing: the engine is synced before validation
            self.sync_weights()
            if cfg.rollout.parity_interval and self.step % cfg.rollout.parity_interval == 0:
                self._check_parity(tolerance=cfg.rollout.parity_tolerance)
        times["time/sync"] = time.time() - t_sync
        metrics = {**loss_metrics, **(self._rollout_metrics(rollout) if rollout else {}), **times}
        metrics["time/step"] = time.time() - t0
        if self.rank == 0 and rollout is not None:
            self.run_log.samples(self.step, [
                {"prompt": self.tokenizer.decode(s.prompt_ids), "response": t, "finish_reason": s.finish_reason,
                 "reward": float(r)}
                for s, t, r in list(zip(rollout.samples, rollout.texts, rollout.batch.rewards_B))[
                    :cfg.logging.samples_per_step]])
        return metrics

    def _rollout_and_score(self, examples, times: dict) -> "ScoredRollout":
        """Generate, then score the responses with the actor (log pi_old) and the teacher (log q)."""
        cfg, needs = self.cfg, self.needs
        t = time.time()
        samples = self._generate([ex.prompt_ids for ex in examples])
        batch = build_rollout_batch(samples, self.pad_id, cfg.trainer.samples_per_prompt)
        times["time/rollout"] = time.time() - t
        overlap_k = cfg.metrics.overlap_k if self.teacher is not None else 0
        t = time.time()
        old = score_tokens(self.actor_runner, batch.tokens_BS, cfg.trainer.micro_batch_size, self.temperature,
                           topk=max(needs.student_topk, overlap_k), entropy=overlap_k > 0)
        batch.old_logprobs_BT = old.logprobs_BT
        times["time/actor_logprobs"] = time.time() - t
        support = old.topk_ids_BTK[..., :needs.student_topk] if needs.student_topk else None
        teacher = None
        t = time.time()
        if self.teacher is not None:
            with on_gpu_while_used(self.teacher.model, cfg.teacher.offload_between_uses):
                teacher = score_tokens(self.teacher_runner, batch.tokens_BS, cfg.trainer.micro_batch_size,
                                       self.temperature, topk=max(needs.teacher_topk, overlap_k),
                                       entropy=overlap_k > 0, at_ids_BTK=support)
            batch.teacher_logprobs_BT = teacher.logprobs_BT
        times["time/teacher"] = time.time() - t
        texts, batch.rewards_B = self._texts_and_rewards(samples, examples)
        return ScoredRollout(batch, old, teacher, support, samples, texts)

    # ------------------------------------------------------------------------------------- rollouts
    def _build_engine(self):
        """The rollout engine on rank 0 (None on the other ranks)."""
        if self.rank != 0:
            return None
        from megaopd.rollout import build_engine

        return build_engine(self.cfg.rollout, self._engine_hf_dir())

    def _engine_hf_dir(self) -> str:
        """An HF directory with the student's architecture and tokenizer. The engine builds from it and the
        actor's weights are synced in right after; a Megatron-checkpoint student is exported first."""
        from megaopd.models.checkpoint import is_megatron_checkpoint

        if not is_megatron_checkpoint(self.cfg.student.path):
            return self.cfg.student.path
        return os.path.join(self.cfg.run.dir, "hf_init")

    def _sampling_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, n=self.cfg.trainer.samples_per_prompt,
                              seed=self.cfg.trainer.seed * 1_000_003 + self.step)

    def _generate(self, prompts: list[list[int]]):
        samples = None
        if self.rank == 0:
            samples = self.engine.generate(prompts, self._sampling_params())
            if self.cfg.rollout.colocated:
                self.engine.release_memory()  # the actor trains on these GPUs next
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _texts_and_rewards(self, samples, examples) -> tuple[list[str], torch.Tensor]:
        """Decoded responses and math-verify rewards (rank 0 computes, every rank receives)."""
        box = [None]
        if self.rank == 0:
            n = self.cfg.trainer.samples_per_prompt
            texts = [self.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
            golds = [examples[i // n].answer for i in range(len(samples))]
            box = [(texts, math_verify_rewards(texts, golds))]
        dist.broadcast_object_list(box, src=0)
        texts, rewards = box[0]
        return texts, torch.tensor(rewards, dtype=torch.float32)

    # ----------------------------------------------------------------------------------------- train
    def _train(self, rollout: "ScoredRollout | None", golden) -> dict:
        cfg = self.cfg.trainer
        mask_BT = None
        if rollout is not None:
            mask_BT = rollout.batch.loss_mask_BT
            if self.special_ids:
                mask_BT = mask_first_occurrences(rollout.batch.targets_BT, mask_BT, self.special_ids)
        B = rollout.batch.size if rollout is not None else 0
        P, M = cfg.prompts_per_step, cfg.mini_batches_per_step
        per_step_metrics: list[dict] = []
        grad_norms = []
        for j in range(M):
            rows = torch.arange(j * B // M, (j + 1) * B // M)
            golden_rows = torch.arange(j * P // M, (j + 1) * P // M) if golden is not None else None
            micro = self._micro_batches(rollout, mask_BT, golden, rows, golden_rows)
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            with on_gpu_while_used(self.partner, self.partner_offload):
                results = self.train_runner.run([m.tokens_BS for m in micro], self._step_fn(micro),
                                                forward_only=False)
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise FloatingPointError(f"step {self.step}: non-finite gradients; lower optimizer.lr or check the data")
            self.scheduler.step(increment=1)
            grad_norms.append(float(grad_norm or 0.0))
            per_step_metrics.extend(results or [])
        metrics = _reduce_loss_metrics(per_step_metrics, is_reporter=self._is_metrics_reporter())
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _is_metrics_reporter(self) -> bool:
        pgs = self.actor_pgs
        return pgs.tp.rank() == 0 and pgs.pp.rank() == pgs.pp.size() - 1

    def _micro_batches(self, rollout, mask_BT, golden, rows, golden_rows) -> list[MicroBatchData]:
        """This DP rank's share of one mini-batch, cut into equal-shaped micro-batches: each holds up to
        micro_batch_size on-policy rows, then its share of the golden rows, then padding rows.

        Global counts (the denominators of every loss) are taken over the whole mini-batch here, which
        every rank holds, so gradient accumulation and DP summation reproduce the big-batch gradient.
        """
        cfg, needs, pgs = self.cfg.trainer, self.needs, self.actor_pgs
        counts, S = {}, 0
        local = torch.arange(0)
        if rollout is not None:
            counts["global_num_tokens"] = float(mask_BT[rows].sum())
            counts["global_num_seqs"] = float((mask_BT[rows].sum(-1) > 0).sum())
            local = rows[list(dp_rows(len(rows), pgs))]
            S = rollout.batch.tokens_BS.shape[1]
        g_local = None
        if golden is not None:
            g_mask_BT = golden.loss_mask_BT[:, 1:]  # position t predicts token t + 1
            counts["global_num_golden_tokens"] = float(g_mask_BT[golden_rows].sum())
            counts["global_num_golden_seqs"] = float((g_mask_BT[golden_rows].sum(-1) > 0).sum())
            g_local = golden_rows[list(dp_rows(len(golden_rows), pgs))]
            S = max(S, golden.input_ids_BT.shape[1])
        T = S - 1
        # On-policy rows per micro-batch, and golden rows per micro-batch.
        mbs = cfg.micro_batch_size if rollout is not None else 0
        if rollout is not None:
            n_micro = max(1, -(-len(local) // mbs))
            g_per = 0 if g_local is None else -(-len(g_local) // n_micro)
        else:  # SFT only: micro-batches of golden rows
            g_per = cfg.micro_batch_size
            n_micro = max(1, -(-len(g_local) // g_per))

        def pad_to(x, length, value=0):  # [rows, L(, K)] -> [rows, length(, K)] along dim 1
            if x.shape[1] == length:
                return x
            pad = torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), value, dtype=x.dtype)
            return torch.cat([x, pad], dim=1)

        out = []
        for i in range(n_micro):
            r = local[i * mbs:(i + 1) * mbs]
            gr = g_local[i * g_per:(i + 1) * g_per] if g_local is not None else torch.arange(0)

            def rows_of(x, fill=0):
                """On-policy rows of x (padded to mbs), then g_per rows of fill: [mbs + g_per, ...]."""
                x = pad_rows(x[r], mbs, fill)
                return torch.cat([x, torch.full((g_per, *x.shape[1:]), fill, dtype=x.dtype)]) if g_per else x

            def per_token(x_BT, fill=0.0):  # [B, T'(, K)] -> this micro-batch's rows, [rows, T(, K)]
                return pad_to(rows_of(x_BT, fill), T, fill)

            tokens = torch.full((mbs + g_per, S), self.pad_id, dtype=torch.long)
            loss_mask = torch.zeros(mbs + g_per, T)
            golden_mask = torch.zeros(mbs + g_per, T)
            extras = {"counts": counts}
            if rollout is not None:
                batch = rollout.batch
                tokens = pad_to(rows_of(batch.tokens_BS, self.pad_id), S, self.pad_id)
                loss_mask = per_token(mask_BT)
                extras["old_logprobs_BT"] = per_token(rollout.old.logprobs_BT)
                if rollout.teacher is not None:
                    extras["teacher_logprobs_BT"] = per_token(rollout.teacher.logprobs_BT)
                if needs.teacher_topk:
                    extras["teacher_topk_ids_BTK"] = per_token(rollout.teacher.topk_ids_BTK[..., :needs.teacher_topk], 0)
                    extras["teacher_topk_logprobs_BTK"] = per_token(
                        rollout.teacher.topk_logprobs_BTK[..., :needs.teacher_topk])
                if needs.student_topk:
                    extras["student_topk_ids_BTK"] = per_token(rollout.student_support, 0)
                    extras["student_topk_teacher_logprobs_BTK"] = per_token(rollout.teacher.at_ids_logprobs_BTK)
                if needs.rewards:
                    extras["rewards_S"] = rows_of(batch.rewards_B)
                    # Golden and padding rows get groups of their own (no loss tokens, no effect on others).
                    extras["group_ids_S"] = torch.where(torch.arange(mbs + g_per) < len(r), rows_of(batch.group_ids_B),
                                                        batch.size + torch.arange(mbs + g_per))
            if g_per:
                tokens[mbs:] = pad_to(pad_rows(golden.input_ids_BT[gr], g_per, self.pad_id), S, self.pad_id)
                golden_mask[mbs:] = pad_to(pad_rows(golden.loss_mask_BT[gr][:, 1:], g_per), T)
            out.append(MicroBatchData(tokens, loss_mask, golden_mask, extras))
        return out

    def _step_fn(self, micro: list[MicroBatchData]):
        needs, pgs = self.needs, self.actor_pgs

        def step_fn(mb, logits_BSv, partner_BSv):
            d = micro[mb.index]
            logits_BTv = logits_BSv[:, :-1]
            targets_BT = d.tokens_BS[:, 1:]
            partner_BTv = partner_BSv[:, :-1] if partner_BSv is not None else None
            inputs = LossInputs(
                logits_BTv=logits_BTv, token_ids_BT=targets_BT, loss_mask_BT=d.loss_mask_BT, tp_group=pgs.tp,
                temperature=self.temperature,
                old_logprobs_BT=d.extras.get("old_logprobs_BT"), teacher_logprobs_BT=d.extras.get("teacher_logprobs_BT"),
                teacher_topk_ids_BTK=d.extras.get("teacher_topk_ids_BTK"),
                teacher_topk_logprobs_BTK=d.extras.get("teacher_topk_logprobs_BTK"),
                student_topk_ids_BTK=d.extras.get("student_topk_ids_BTK"),
                student_topk_teacher_logprobs_BTK=d.extras.get("student_topk_teacher_logprobs_BTK"),
                ref_logits_BTv=partner_BTv if needs.reference else None,
                teacher_logits_BTv=partner_BTv if needs.teacher_logits else None,
                rewards_S=d.extras.get("rewards_S"), group_ids_S=d.extras.get("group_ids_S"),
                golden_logits_BTv=logits_BTv if needs.golden else None,
                golden_ids_BT=targets_BT if needs.golden else None,
                golden_mask_BT=d.golden_mask_BT if needs.golden else None,
                **d.extras["counts"],
            )
            loss, metrics = self.loss_fn(inputs)
            metrics = {k: v.detach().float() for k, v in metrics.items()}
            if "loss/total" not in metrics:  # a single loss: it is both the total and its one term
                metrics["loss/total"] = metrics[f"{self.loss_fn.name}/loss"] = loss.detach().float()
            return loss, metrics

        return step_fn

    # ------------------------------------------------------------------------------- sync and parity
    def _hf_tensors(self):
        """Full HF-named tensors of the actor, gathered over TP and collected over PP (collective)."""
        return gather_hf_weights(model_state(self.actor.model), self.actor.hf, self.actor_pgs.tp, self.actor_pgs.pp)

    def sync_weights(self) -> None:
        """Actor shards -> HF tensors -> rollout engine (collective; megaopd.sync)."""
        self.weight_sync.push(self.actor.model, self.actor.hf, self.actor_pgs, weight_version=str(self.step))

    def _check_parity(self, tolerance: float) -> float:
        """Engine vs actor log-probs on fixed probe sequences (the first prompts' golden solutions):
        what the engines generate with must be what the actor trained."""
        probe = [ex.golden_ids[:64] for ex in self.loader.batch_at_step(0)[:4]]
        box = [None]
        if self.rank == 0:
            if hasattr(self.engine, "prompt_logprobs"):
                box = [[self.engine.prompt_logprobs(list(map(int, p)))[1:] for p in probe]]
            else:
                self.run_log.console("parity check skipped: these engines expose no prompt log-probs; every "
                                     "step's sync/logprob_gap_* still compares engine and actor log-probs")
        dist.broadcast_object_list(box, src=0)
        engine_lp = box[0]
        if engine_lp is None:
            return 0.0
        S = max(len(p) for p in probe)
        tokens = torch.full((len(probe), S), self.pad_id, dtype=torch.long)
        for b, p in enumerate(probe):
            tokens[b, :len(p)] = torch.as_tensor(list(p))
        actor = score_tokens(self.actor_runner, tokens, self.cfg.trainer.micro_batch_size, 1.0).logprobs_BT
        gap = max(max(abs(e - a) for e, a in zip(lp, actor[b, :len(lp)].tolist())) for b, lp in enumerate(engine_lp))
        if self.rank == 0:
            self.run_log.console(f"weight-sync parity at step {self.step}: max |engine - actor| log-prob = {gap:.2e}")
        if gap > tolerance:
            raise RuntimeError(f"engine and actor log-probs differ by {gap:.3g} > rollout.parity_tolerance="
                               f"{tolerance} after the weight sync at step {self.step}: the sync or the engine's "
                               f"model is broken (check the HF <-> Megatron mapping and the engine's dtype)")
        return gap

    # --------------------------------------------------------------------------------------- metrics
    def _rollout_metrics(self, rollout: "ScoredRollout") -> dict:
        if self.rank != 0:
            return {}
        mcfg, batch, old, teacher = self.cfg.metrics, rollout.batch, rollout.old, rollout.teacher
        finish = ["length" if t else "stop" for t in batch.truncated_B.tolist()]
        mask = batch.loss_mask_BT  # every generated token (repetitive n-grams need them all)
        out = response_metrics(rollout.texts, finish, mcfg.repetition)
        adv_BT = (teacher.logprobs_BT - old.logprobs_BT) * mask if teacher is not None else None
        out.update(rollout_dynamics(batch.response_lens_B, mask, old.logprobs_BT,
                                    teacher.logprobs_BT if teacher is not None else None, adv_BT))
        if adv_BT is not None:
            rep_BT = repetitive_token_mask(batch.targets_BT, mask, mcfg.repetition.ngram)
            split = advantage_split(adv_BT, rep_BT, mask)
            out.update({"adv/regular_mean": split["adv/regular_mean"],
                        "adv/repetitive_mean": split["adv/repetitive_mean"],
                        "adv/repetitive_token_share": split["adv/repetitive_share"]})
            if mcfg.overlap_k:
                k = mcfg.overlap_k
                out.update(topk_overlap(old.topk_ids_BTK[..., :k], old.topk_logprobs_BTK[..., :k],
                                        teacher.topk_ids_BTK[..., :k], mask, old.entropy_BT, teacher.entropy_BT))
        gap = (batch.engine_logprobs_BT - old.logprobs_BT).abs()[mask.bool()]
        out["sync/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        out["sync/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        out["rollout/reward_mean"] = float(batch.rewards_B.mean())
        return out

    def _validate(self) -> dict:
        vcfg = self.cfg.validation
        if not vcfg.path:
            return {}
        if not self.needs.on_policy:
            self.sync_weights()
        box = [None]
        if self.rank == 0:
            from megaopd.data.templates import render_and_encode
            from megaopd.eval.benchmarks import load_benchmark_file
            from megaopd.eval.evaluate import EvalConfig, evaluate

            bench = load_benchmark_file(vcfg.path, name="val", samples=vcfg.samples)
            result = evaluate(
                self.engine, self.tokenizer, [bench],
                EvalConfig(samples=vcfg.samples, temperature=vcfg.temperature, max_new_tokens=vcfg.max_new_tokens,
                           limit=vcfg.max_problems or None, repetition=self.cfg.metrics.repetition),
                out_dir=os.path.join(self.cfg.run.dir, "eval", f"step_{self.step:06d}"),
                prompt_fn=lambda problem: render_and_encode(problem, self.cfg.data, self.tokenizer)[1])
            box = [{k: v for k, v in result.to_metrics("val").items() if k.count("/") == 1}]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _log(self, metrics: dict) -> None:
        self._last_metrics = metrics
        if self.rank != 0:
            return
        self.run_log.log_step(self.step, metrics)
        rates = {"truncation_rate": metrics.get("rollout/truncation_rate"),
                 "repetition_rate": metrics.get("rollout/repetition_rate")}
        for warning in self.detector.update(self.step, rates):
            self.run_log.event(self.step, "collapse_warning", warning.message, loud=True, metric=warning.metric,
                               value=warning.value)

    def _console(self, line: str) -> None:
        if self.run_log is not None:
            self.run_log.console(line)
        else:
            print(line, flush=True)

    # ------------------------------------------------------------------------------ checkpoint/export
    def save(self) -> None:
        state = {"scheduler": self.scheduler.state_dict(), "data": self.loader.state_dict(),
                 "collapse": self.detector.state_dict(), "weight_version": str(self.step),
                 "student": self.cfg.student.path, "teacher": self.cfg.teacher.path}
        path = save_checkpoint(self.cfg.run.dir, self.step, self.actor.model, self.optimizer, self.actor_pgs, state,
                               self.actor.hf, hf_side_dir=tokenizer_dir(self.actor.path))
        if self.rank == 0:
            self.run_log.event(self.step, "checkpoint", path)

    def export_hf(self, out_dir: str) -> None:
        """The student's current weights as an HF directory (safetensors + config + tokenizer)."""
        from megaopd.models.hf_io import save_hf_dir

        tensors = self._hf_tensors()
        if self.rank == 0:
            save_hf_dir(out_dir, list(tensors), side_files_from=self.actor.path)
        else:
            for _ in tensors:
                pass
        dist.barrier()


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


def _reduce_loss_metrics(results: list[dict], is_reporter: bool) -> dict:
    """Loss metrics of the step on rank 0: per-micro-batch loss shares are summed (each already divides
    by the step's global count), other metrics averaged over micro-batches and DP ranks. Term losses
    are renamed "<term>/loss" -> "loss/<term>"."""
    local = results if is_reporter else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = [m for part in gathered for m in part]
    if not merged:
        return {}
    out = {}
    for key in merged[0]:
        values = [float(m[key]) for m in merged if key in m]
        is_share = key == "loss/total" or key.endswith("/loss")
        value = sum(values) if is_share else sum(values) / len(values)
        name = f"loss/{key[:-len('/loss')]}" if key.endswith("/loss") else key
        out[name] = value
    return out


def run_worker(rank: int, world_size: int, cfg: MegaOPDConfig) -> dict | None:
    """One rank of `megaopd train` (spawned on CPU, or the torchrun process itself)."""
    trainer = Trainer(cfg)
    summary = trainer.train()
    if trainer.run_log is not None:
        trainer.run_log.close()
    return summary if rank == 0 else None


def write_summary(run_dir: str, summary: dict) -> str:
    path = os.path.join(run_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=float)
    return path
