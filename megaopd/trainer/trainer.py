"""The OPD step loop (docs/architecture.md "One training step"), for every algorithm of docs/algorithms.md.

    prompts (+ golden solutions)                       data: the same global batch on every rank
    -> rollout: engines generate n responses each      rank 0 drives the engines; every rank gets the record
    -> scoring: actor log pi_old (+ top-k, entropy)    each model in its own TP/PP layout (megaopd.scoring)
                teacher log q (+ top-K, at the student's top-k)
    -> rewards (math-verify, rank 0)
    -> train: per mini-batch, micro-batches (megaopd.batching) through the pipeline runner with
              the reference (or, for GKD, the teacher) in lockstep -> loss -> backward -> Adam step
    -> sync: actor shards -> HF tensors -> engines     then metrics, validation every N, checkpoint every M

Every rank holds the rollout's per-row lengths, finish reasons and rewards (global token counts and the DP
partition are then local arithmetic), but the token ids, masks and per-token scores only of the rows it
trains or scores (batching.delivery; batching.owners.RowOwners, from batching.shares.row_owners): whole-batch
metrics reduce scalars.

    python -m megaopd.cli train examples/tiny/stable_opd.yaml run.dir=runs/tiny
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megaopd.batching.micro_batches import MicroBatch, MiniBatch, step_micro_batches
from megaopd.batching.settings import BatchingSettings
from megaopd.batching.shares import mini_batch_rows
from megaopd.data import PromptDataset, PromptLoader, golden_batch
from megaopd.data.special_tokens import stop_tokens
from megaopd.data.teacher_view import TeacherPrompt
from megaopd.data.vocab import loss_mask_ids
from megaopd.losses import Source, mask_first_occurrences
from megaopd.metrics import CollapseDetector, math_verify_rewards
from megaopd.models.checkpoint import base_model_of
from megaopd.models.gather import gather_adapter_weights, gather_hf_weights, model_state
from megaopd.models.hf_io import load_tokenizer, save_hf_dir, save_peft_adapter, tokenizer_dir
from megaopd.models.lora import BaseView
from megaopd.models.weights import adapted_linears
from megaopd.parallel.dist import device as dist_device
from megaopd.parallel.dist import holds_results, init_distributed, rank0_computes
from megaopd.rollout.records import RolloutBatch
from megaopd.rollout.trajectories import MultiTurn
from megaopd.rollout.waits import WaitAbandoned
from megaopd.scoring import bounds_for, check_engine_parity
from megaopd.scoring.passes import ScoreRequest, score_sequences
from megaopd.scoring.runner import PipelineRunner
from megaopd.sync.weight_sync import expert_group
from megaopd.trainer.checkpoint import Checkpointer
from megaopd.trainer.loss_control import ControlledLoss
from megaopd.trainer.nonfinite import NonFinite, describe
from megaopd.trainer.optim import RouterAuxLoss, build_optimizer, wrap_for_training
from megaopd.trainer.preemption import PreemptionFlag
from megaopd.trainer.roles import build_models, check_teacher_tokenizers, on_gpu_while_used
from megaopd.trainer.rollout_flow import ActorWeights, EngineHooks, RolloutFlow
from megaopd.trainer.rollout_stage import RolloutStage, StepContext
from megaopd.trainer.run_folder import agreed_resume_point
from megaopd.trainer.run_log import RunLog, RunSummary, keep_rows_through
from megaopd.trainer.step_metrics import (
    StepResult,
    StepTimes,
    TrainMetrics,
    flop_metrics,
    reduce_loss_metrics,
    rollout_metrics,
    sample_rows,
    step_work,
)
from megaopd.trainer.timer import Timer
from megaopd.trainer.validation import validate

if TYPE_CHECKING:  # annotations only: config composes every package's section, so no package imports it
    from megaopd.config.schema import MegaOPDConfig


class Trainer:
    """One rank of an OPD job. Start-up order: inputs (tokenizers, data), models, the step's stages, the
    checkpointed state (registered once, every component existing), resume, engine; bad input fails before
    anything expensive runs."""

    def __init__(self, cfg: MegaOPDConfig, preemption: PreemptionFlag | None = None):
        self.preemption = preemption or PreemptionFlag()  # the rank's entry installs it first (cli.run_worker)
        init_distributed()
        self.cfg, self.rank = cfg, dist.get_rank()
        self.run_log: RunLog | None = None  # created once the run folder's state is known
        torch.manual_seed(cfg.trainer.seed)
        self.loss_fn = ControlledLoss(cfg.loss)  # with loss.controller=adaptive, its weights follow the rollouts
        self.needs = self.loss_fn.needs
        self.temperature = cfg.rollout.temperature
        self._load_inputs()
        self._load_models()
        self._build_stages()
        # A LoRA student's adapters apply to its HF base: checkpoints and the peft export name it.
        self.base_model = base_model_of(cfg.student.path) if cfg.student.lora.enabled else ""
        self.checkpointer = Checkpointer(  # what a checkpoint saves and resume restores, named once
            run_dir=cfg.run.dir,
            model=self.actor.model,
            optimizer=self.optimizer,
            pgs=self.actor_pgs,
            components={
                "scheduler": self.scheduler,
                "data": self.flow,  # the loader's cursor before any batch drawn ahead
                "collapse": self.detector,
                **self.loss_fn.stateful,
            },
            hf_cfg=self.actor.hf,
            hf_side_dir=tokenizer_dir(self.actor.path),
            model_meta={"base_model": self.base_model} if self.base_model else {},
        )
        self._resume()
        self._start_engine()

    def _load_inputs(self) -> None:
        """Tokenizers and data first: a bad file fails here, before any model is loaded."""
        cfg = self.cfg
        self.tokenizer = tok = load_tokenizer(cfg.student.path)
        teachers = cfg.teachers  # in-job or served: each names an HF directory with its tokenizer
        teacher_tokenizers = [load_tokenizer(t.path) for t in teachers]
        teacher_tokenizer = teacher_tokenizers[0] if teachers else None  # the template of data.prompt_template
        # Rollouts stop at the template's turn end and the EOS; golden solutions end with the first of them.
        self.stop = stop_tokens(cfg.data, tok, teacher_tokenizer)
        cross: set[str] = set()  # teachers of another vocabulary (teacher.tokenizer=own)
        report = check_teacher_tokenizers(
            tok, cfg.student.path, teachers, teacher_tokenizers, self.stop.ids, self._console, cross
        )
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.special_ids = loss_mask_ids(tok, cfg.loss.mask_first_tokens, report)
        self.multi_turn = (
            MultiTurn(cfg.env, cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens, tok)
            if cfg.env.enabled
            else None
        )  # trajectories with an environment's turns; None: single-turn rows
        # Teachers that read a sequence of their own: how each makes its prefix of a row (data.teacher_view).
        self.teacher_prompts = {
            t.name: TeacherPrompt(
                context=t.context,
                data=cfg.data,
                tokenizer=t_tok if t.tokenizer == "own" else tok,
                own=t.tokenizer == "own",
                student_tokenizer=tok if t.name in cross else None,
                tools=self.multi_turn.tools if self.multi_turn else None,
            )
            for t, t_tok in zip(teachers, teacher_tokenizers)
            if t.own_view or cfg.data.teacher_prompt == "own"
        }
        dataset = PromptDataset.load(
            cfg.data,
            tok,
            teacher_tokenizer,
            log=self._console if self.rank == 0 else None,
            tools=self.multi_turn.tools if self.multi_turn else None,
        )
        # Every rank draws the same global batch (rank 0 generates it; every layout takes its own rows).
        self.loader = PromptLoader(dataset, cfg.data, batch_size=cfg.trainer.prompts_per_step)

    def _load_models(self) -> None:
        cfg = self.cfg
        self.models = build_models(cfg, self.needs, self.preemption.signalled, self.teacher_prompts)  # served
        self.actor, self.actor_pgs = self.models.actor, self.models.actor.pgs
        if isinstance(self.models.partner, BaseView):  # what `megaopd plan` promised: no reference weights held
            self._console(
                "[models] reference: the student's base with its LoRA adapters off (no reference model loaded)"
            )
        self.ddp = wrap_for_training(self.actor.model, self.actor_pgs, cfg.optimizer.use_distributed_optimizer)
        self.router_aux = RouterAuxLoss(self.actor.model)
        self.optimizer, self.scheduler = build_optimizer(
            self.ddp, cfg.optimizer, cfg.trainer.max_steps * cfg.trainer.mini_batches_per_step
        )
        self.train_runner = PipelineRunner(
            self.ddp,
            self.actor_pgs,
            self.actor.hf.vocab_size,
            partner=self.models.partner,
            logits_chunk_tokens=cfg.trainer.logits_chunk_tokens,
        )
        # What the passes score besides log-probs: what the loss's inputs read of each (LossNeeds declares them),
        # and the overlap metrics' top-k and entropy.
        overlap_k = cfg.metrics.overlap_k if self.models.teachers is not None else 0
        self.actor_request = ScoreRequest.for_loss(self.needs, Source.ACTOR, self.temperature, overlap_k)
        self.teacher_request = ScoreRequest.for_loss(self.needs, Source.TEACHER, self.temperature, overlap_k)
        t = cfg.trainer
        self.batching = BatchingSettings(  # the training step's micro-batches (and so the rows each replica owns)
            t.prompts_per_step,
            t.mini_batches_per_step,
            t.micro_batch_size,
            self.pad_id,
            max_tokens=t.max_tokens_per_micro_batch if t.pack_sequences and self.train_runner.packs else None,
            uniform=self.actor_pgs.pp.size() > 1,
            multiple=self.train_runner.seq_multiple,
        )
        self.context = StepContext(
            cfg=cfg,
            models=self.models,
            needs=self.needs,
            batching=self.batching,
            pad_id=self.pad_id,
            actor_request=self.actor_request,
            teacher_request=self.teacher_request,
        )

    def _build_stages(self) -> None:
        """The rollout flow (its engine comes last, in _start_engine), the rollout stage over it, the phase
        timer and the collapse detector."""
        cfg = self.cfg
        self.timer = Timer()
        self.detector = CollapseDetector(cfg.metrics.collapse)
        self.flow = RolloutFlow(
            cfg,
            self.loader,
            self.timer,
            self.stop.ids,
            self.rank,
            EngineHooks(
                parity=self.check_parity,
                actor=ActorWeights(model=self.actor.model, hf=self.actor.hf, pgs=self.actor_pgs),
                on_policy=self.needs.on_policy,
            ),
            self.multi_turn,  # rollout.mode: which prompts, which samples, when syncs
        )
        self.rollout_stage = RolloutStage(self.flow, self.context)

    def _resume(self) -> None:
        """Step 0, or the state of the run folder's last complete checkpoint."""
        cfg = self.cfg
        self.step, self._last_metrics = 0, {}
        self._served_log: dict[str, float] = {}  # the step's served-teacher log (_rollout's)
        # Rank 0 picks the step folder (verified; moved aside what it skips, docs/run_folder.md); every rank loads it.
        point = agreed_resume_point(cfg.run.dir, cfg.run.start_over)
        latest = point.path
        if latest is not None:
            self.step = self.checkpointer.load(latest)
        self._saved = self.step  # the step a checkpoint holds (step 0: the start itself, nothing to save)
        if self.rank == 0:
            # metrics.jsonl holds each step once: rows after the loaded step go to a side file before new ones.
            point.notes += keep_rows_through(cfg.run.dir, self.step if latest is not None else -1)
            self.run_log = RunLog(
                cfg.run.dir,
                cfg.trainer.max_steps,
                cfg.logging.tensorboard,
                cfg.logging.progress_bar,
                start_step=self.step,
                wandb=cfg.logging.wandb,
                config=dataclasses.asdict(cfg),
            )
            for note in point.notes:
                self.run_log.console(note)
            if latest is not None:
                self.run_log.console(f"resumed from {latest} at step {self.step}")

    def _start_engine(self) -> None:
        """The rollout engine (rank 0), holding the actor's current weights, checked by the parity probe.
        Rollouts and validation generate; an SFT run without validation needs no engine at all."""
        from megaopd.models.checkpoint import is_megatron_checkpoint
        from megaopd.rollout import build_engine

        cfg = self.cfg
        if not (self.needs.on_policy or cfg.validation.path):
            return  # the flow holds no engine: nothing generates (SFT without validation)
        hf_dir = cfg.student.path
        if cfg.rollout.engine.in_trainer and is_megatron_checkpoint(cfg.student.path):
            hf_dir = os.path.join(cfg.run.dir, "hf_init")
            export_hf(self.actor, hf_dir)  # collective; the engine is built from it
        self.flow.attach(
            build_engine(
                cfg.rollout,
                hf_dir,
                cfg.generated_row_tokens(),
                cfg.embedded_engine_dtype(),
                stop=self.preemption.signalled,
            )
            if self.rank == 0
            else None
        )
        self.flow.first_sync(self.step)  # stopping: a signal ended its waits, train() just leaves

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> RunSummary:
        cfg = self.cfg.trainer
        summary = RunSummary(start_step=self.step, end_step=self.step)
        flow = self.flow  # it owns the engine, its weights and whether the run is stopping
        if self.step == 0 and cfg.eval_interval and not flow.stopping:
            summary.val_before = self._validate()
            if self.rank == 0 and summary.val_before:
                self.run_log.log_step(0, summary.val_before)  # the "before" point of the figures
        step_times = []
        while self.step < cfg.max_steps and not flow.stopping:
            try:
                result = self.train_step()
            except WaitAbandoned:  # collective (megaopd.rollout.waits): a signal ended rank 0's wait on the engines
                flow.abandon(self.step)  # the step in flight is not trained: its batch is drawn again; stopping
                break
            step_times.append(result.times.step)
            if (
                not flow.stopping
                and cfg.eval_interval
                and (self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps)
            ):
                result = dataclasses.replace(result, validation=self._validate())
            self._log(result)
            if self.step % cfg.save_interval == 0 or self.step == cfg.max_steps:
                self.save()
                flow.stop(self.preemption.should_stop())  # collective: a signal during the save, no next step
        if flow.stopping:  # preempted: the last complete step is checkpointed (now, or it already was)
            if self._saved != self.step:
                self.save()
            self._console(f"preemption signal received: checkpoint of step {self.step} saved, exiting")
            flow.close()
            summary.end_step, summary.preempted = self.step, True
            return summary
        export_hf(self.actor, os.path.join(self.cfg.run.dir, "hf"))
        if self.base_model:  # beside the merged student: its peft adapter folder for the HF base
            export_adapter(self.actor, os.path.join(self.cfg.run.dir, "hf_adapter"), self.base_model)
        summary.end_step, summary.last_metrics = self.step, self._last_metrics or {}
        summary.step_time_mean = sum(step_times) / max(len(step_times), 1)
        flow.close()
        return summary

    def train_step(self) -> StepResult:
        timer = self.timer
        with timer("step"):
            examples = self.flow.examples(self.step)
            golden = golden_batch(examples, self.pad_id) if self.needs.golden else None
            self._served_log = {}
            rollout = self._rollout(examples, golden) if self.needs.on_policy else None
            with timer("train"):
                train = self._train(rollout, golden)
            self.step += 1
            # Collective: every rank stops after the same step, even if the signal reached only some. After a
            # preemption signal nothing talks to the engines (Slurm may have killed them): straight to the save.
            self.flow.stop(self.preemption.should_stop())
            with timer("sync"):
                # SFT-only steps generate nothing: their weights are synced before validation.
                if rollout is not None:  # sync mode: now; overlapped: at the next batch (not once stopping)
                    self.flow.after_step(self.step)  # stopping: a signal ended the push
            step, controller = None, {}
            if rollout is not None:  # collective: each replica sums over its rows, one small gather; then (every
                step = rollout_metrics(rollout, self.cfg.metrics, contributes=self.owners.sends)  # rank) the
                controller = self.loss_fn.observe(self.step, step.signals, self.run_log)  # controller moves on them
            if rollout is not None and self.rank == 0:
                self.run_log.samples(self.step, sample_rows(rollout, self.tokenizer, self.cfg.logging.samples_per_step))
        times = StepTimes(**timer.reduce(dist.group.WORLD, dist_device()))  # collective: the slowest rank's
        return StepResult(
            train=train,
            controller=controller,
            rollout=step,
            flow={**self.flow.report.log(), **self.flow.sync_log(), **self._served_log} if self.rank == 0 else {},
            times=times,
            flops=flop_metrics(step_work(self.models, self.needs, self.cfg, rollout, golden), times),
            logs_rollout=self.rank == 0,
        )

    def _rollout(self, examples, golden=None) -> RolloutBatch:
        """Generate, then score the responses with the actor (log pi_old) and the teacher (log q). The scores
        land on the ranks that train each row (self.owners: row_owners, the partition of _train), only there.
        The served teachers' log (rank 0, rollout.stream_parts > 1: the share of their rows scored part by
        part) goes to self._served_log, which the step's result takes."""
        cfg, timer = self.cfg, self.timer
        with timer("rollout"):  # the batch in parts as it generates (rollout.stream_parts), or whole: one path
            generated = self.rollout_stage.generate(self.step, examples, golden)  # each part to every scorer
        batch, self.owners, samples = generated.batch, generated.owners, generated.samples  # its rows; rank 0's samples
        scored = self.rollout_stage.score(generated, timer)  # time/actor_logprobs, time/teacher
        batch.actor, batch.teacher = scored.actor, scored.teacher
        if scored.served is not None:  # rank 0's threads, overlapped with actor_logprobs (0 on the other ranks)
            timer.add("teacher_remote", scored.served.seconds)
            if self.rank == 0 and cfg.rollout.stream_parts > 1:
                self._served_log = scored.served.log()
        batch.texts, rewards = texts_and_rewards(
            self.tokenizer, samples, examples, cfg.trainer.samples_per_prompt, self.multi_turn, cfg.metrics.reward
        )
        batch.rewards_B = torch.tensor(rewards, dtype=torch.float32)
        return batch

    # ----------------------------------------------------------------------------------------- train
    def _train(self, rollout: RolloutBatch | None, golden) -> TrainMetrics:
        """One optimizer step per mini-batch of the step's rows."""
        needs, pgs = self.needs, self.actor_pgs
        mask_BT = loss_tokens_B = None
        if rollout is not None:
            mask_BT = rollout.loss_mask_BT
            if self.special_ids:
                mask_BT = mask_first_occurrences(rollout.targets_BT, mask_BT, self.special_ids)
            loss_tokens_B = rank0_computes(mask_BT.sum, -1)  # the denominators: rank 0 holds every row
        B = rollout.size if rollout is not None else 0
        P, M = self.batching.prompts_per_step, self.batching.mini_batches
        results, grad_norms, lrs, skipped = [], [], [], 0
        for j in range(M):
            rows, golden_rows = mini_batch_rows(B, P, M, j, golden is not None)  # row_owners' rows too
            micro = step_micro_batches(
                MiniBatch(rollout, mask_BT, golden, rows, golden_rows, loss_tokens_B),
                pgs.dp.rank(),
                pgs.dp.size(),
                needs,
                self.batching,
            )
            self.router_aux.scale_for(micro, pgs.dp)
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            with on_gpu_while_used(self.models.partner, self.models.partner_offload):
                mini = self.train_runner.run(micro, self._loss_step, forward_only=False) or []
            results += mini
            lr = self.scheduler.current_lr()  # the lr this update uses (train/lr), before the schedule moves on
            bad = NonFinite.check(mini, self.ddp)  # collective: one all-reduce of two flags
            if bad:
                self._nonfinite(bad, mini, rows, golden_rows, rollout is not None)
                skipped += 1
                continue  # trainer.skip_nonfinite: no update, the schedule stays
            ok, grad_norm, _ = self.optimizer.step()
            if not ok or not math.isfinite(float(grad_norm or 0.0)):  # finite grads whose norm overflows
                self._nonfinite(NonFinite(False, True), [], rows, golden_rows, rollout is not None)
                skipped += 1  # clipped by an infinite norm: no weight change
                continue
            self.scheduler.step(increment=1)
            grad_norms.append(float(grad_norm or 0.0))
            lrs.append(lr)
        return TrainMetrics(
            loss=reduce_loss_metrics(results, holds_results(pgs)),
            grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
            lr=sum(lrs) / max(len(lrs), 1),
            skipped_nonfinite=skipped if self.cfg.trainer.skip_nonfinite else None,
        )

    def _nonfinite(self, bad: NonFinite, mini: list, rows, golden_rows, on_policy: bool) -> None:
        """Collective: raises one FloatingPointError naming the terms, the step and the rows, or (with
        trainer.skip_nonfinite) says that this update is skipped."""
        dp = self.actor_pgs.dp.rank()
        mine = (
            [r for r in rows.tolist() if self.owners.owner_B[r] == dp]
            if on_policy
            else [f"golden {r}" for r in (golden_rows.tolist() if golden_rows is not None else [])]
        )
        what = describe(bad, mini, mine, dp)
        if self.cfg.trainer.skip_nonfinite:
            self._console(f"step {self.step + 1}: {what}: update skipped (trainer.skip_nonfinite)")
            return
        raise FloatingPointError(
            f"step {self.step + 1}: {what}; the run stops before the update: check the models and the data (a "
            f"teacher or reference of another vocabulary), lower optimizer.lr, or set trainer.skip_nonfinite=true "
            f"to skip such updates"
        )

    def _loss_step(self, mb: MicroBatch, logits_BSv: torch.Tensor, partner_BSv: torch.Tensor | None):
        """The runner's step_fn: the loss of one micro-batch (already on the logits' device)."""
        result = self.loss_fn(mb.loss_inputs(logits_BSv, partner_BSv, self.actor_pgs.tp, self.temperature, self.needs))
        return result.total, result.detached()

    # ------------------------------------------------------------------------------- sync and parity
    def check_parity(self, engine) -> None:
        """The rollout flow's parity hook: `engine` (rank 0's; None elsewhere) vs actor log-probs of fixed probe
        sequences (the first prompts' golden solutions) after a sync; raises when the statistics leave their
        bounds (megaopd/scoring/parity.py)."""
        probe = [list(map(int, ex.golden_ids[:64])) for ex in self.loader.batch_at_step(0)[:4]]
        r, mbs = self.cfg.rollout, self.cfg.trainer.micro_batch_size
        score = functools.partial(
            score_sequences,
            self.models.actor_runner,
            micro_batch_size=mbs,
            pad_id=self.pad_id,
            layout=self.models.actor_layout,
        )
        bounds = bounds_for(
            self.cfg.parity_dtype(),
            r.parity_tolerance,
            r.parity_mean_tolerance,
            r.parity_p99_tolerance,
            r.parity_min_correlation,
        )
        check_engine_parity(engine, score, probe, bounds, self.step, self._console)

    # --------------------------------------------------------------------------- logging and saving
    def _validate(self) -> dict:
        """Collective; a signal ending its waits on the engines stops the run after this (complete) step."""
        if not self.cfg.validation.path:
            return {}

        def run() -> dict:
            engine = self.flow.validation_engine(self.step)  # the engine at the trainer's weights
            return validate(engine, self.tokenizer, self.cfg, self.step, list(self.stop.ids), self.run_log)

        return self.flow.until_given_up(run)

    def _log(self, result: StepResult) -> None:
        """Rank 0 logs the step (its metrics row made here, once) and feeds the collapse detector its rates (a
        step without rollouts, SFT, has none)."""
        self._last_metrics = metrics = result.log()
        if self.rank != 0:
            return
        self.run_log.log_step(self.step, metrics)
        signals = result.signals
        for warning in self.detector.update(self.step, signals.rates()) if signals is not None else []:
            self.run_log.event(
                self.step,
                warning.event,
                warning.message,
                loud=warning.is_collapse,
                metric=warning.metric,
                value=warning.value,
            )

    def _console(self, line: str) -> None:
        if self.rank == 0 and self.run_log is not None:
            self.run_log.console(line)
        elif self.rank == 0:
            print(line, flush=True)  # before the run log exists (start-up): the Slurm log sees it at once

    def save(self) -> None:
        meta = {
            "weight_version": str(self.step),
            "student": self.cfg.student.path,  # for people: never read back
            "teachers": {t.name: t.path or t.urls for t in self.cfg.teachers},
        }
        path = self.checkpointer.save(self.step, meta)
        self._saved = self.step
        if self.rank == 0:
            self.run_log.event(self.step, "checkpoint", path)


def export_hf(actor, out_dir: str) -> None:
    """The student's current weights (`actor`: its RoleModel) as an HF directory (safetensors + config +
    tokenizer); collective: every rank takes part in each gather over TP (and EP) and PP."""
    tensors = gather_hf_weights(
        model_state(actor.model), actor.hf, actor.pgs.tp, actor.pgs.pp, ep_group=expert_group(actor.pgs)
    )  # a stream: one tensor at a time
    if dist.get_rank() == 0:
        save_hf_dir(out_dir, tensors, side_files_from=actor.path)
    else:
        for _ in tensors:
            pass
    dist.barrier()


def export_adapter(actor, out_dir: str, base_model: str) -> None:
    """A LoRA student's adapters as a peft adapter folder (adapter_config.json with base_model_name_or_path =
    base_model, adapter_model.safetensors in peft's names) that peft.PeftModel.from_pretrained loads onto the HF
    base; collective, as export_hf."""
    from megaopd.models.lora import lora_meta

    meta = lora_meta(actor.model)
    state = model_state(actor.model)
    tensors = gather_adapter_weights(state, actor.hf, actor.pgs.tp, actor.pgs.pp)
    if dist.get_rank() == 0:
        save_peft_adapter(
            out_dir, tensors, meta["rank"], meta["alpha"], adapted_linears(state), base_model, meta["dropout"]
        )
    else:
        for _ in tensors:
            pass
    dist.barrier()


def texts_and_rewards(tokenizer, samples, examples, n: int, multi_turn: MultiTurn | None, reward_cfg=None):
    """Collective: the decoded responses on rank 0 (empty on the others: rank 0 logs them and sends the
    metrics made of them) and their math-verify rewards on every rank (trajectories: the student's turns and
    the environment's final-answer rewards)."""
    kept = {}

    def on_rank0():
        if multi_turn is not None:
            kept["texts"], rewards = multi_turn.texts_and_rewards(samples)
            return rewards
        kept["texts"] = [tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
        return math_verify_rewards(kept["texts"], [examples[i // n].answer for i in range(len(samples))], reward_cfg)

    rewards = rank0_computes(on_rank0)
    return kept.get("texts", []), rewards
