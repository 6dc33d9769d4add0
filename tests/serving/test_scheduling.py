"""The scheduler's pause / retract / abort over a real model runner: a weight update loads between two
decode steps of a held batch, a retract re-prefills the running rows under the new weights, an abort
ends them."""

import time

import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.rows import RowRequest
from megaopd.engine.runner import ModelRunner
from megaopd.serving.scheduling import Scheduler
from tests.engine._models import hf_logprobs, random_state_dict

# Two samples of one prompt that run to their budget (no stop ids, as with ignore_eos).
ROWS = [RowRequest(prompt_ids=[5, 6], max_new_tokens=300, seed=s) for s in (3, 4)]


def _wait_until_running(engine):
    while engine.running == 0:
        time.sleep(0.001)


def test_pause_update_retract_and_abort(tiny_dir):
    engine = ModelRunner(EmbeddedEngineConfig(hf_dir=tiny_dir))
    scheduler = Scheduler(engine)
    pauses = scheduler.pauses
    new = random_state_dict(tiny_dir, seed=43)
    pauses.pause("retract")
    pauses.continue_generation()
    job = scheduler.submit(ROWS)
    _wait_until_running(engine)
    pauses.pause("retract")
    engine.update_weights(new.items(), weight_version="v2")  # loads between two decode steps
    pauses.continue_generation()
    results = job.result(timeout=60)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 300 for r in results)
    # Retract re-prefilled under the new weights: the tail's log-probs are the new model's.
    from transformers import Qwen2ForCausalLM

    ref = Qwen2ForCausalLM(engine.model.config).float().eval()
    ref.load_state_dict(new)
    r = results[0]
    lp_new = hf_logprobs(ref, ROWS[0].prompt_ids, r.output_ids, 1.0)
    assert (lp_new[-5:] - torch.tensor(r.logprobs[-5:], dtype=torch.float64)).abs().max() < 1e-4

    job = scheduler.submit(ROWS)
    _wait_until_running(engine)
    pauses.pause("abort")
    results = job.result(timeout=60)
    assert all(r.finish_reason == "abort" and len(r.output_ids) < 300 for r in results)
    pauses.continue_generation()
    assert scheduler.run([RowRequest(prompt_ids=[5], max_new_tokens=2)], timeout=60)[0].finish_reason == "length"
    scheduler.stop()


def test_abort_all_ends_queued_rows_without_pausing(tiny_dir):
    engine = ModelRunner(EmbeddedEngineConfig(hf_dir=tiny_dir))
    scheduler = Scheduler(engine)
    running = scheduler.submit(ROWS)
    _wait_until_running(engine)
    queued = scheduler.submit([RowRequest(prompt_ids=[7, 8], max_new_tokens=300, seed=5)])  # joins the next batch
    scheduler.pauses.abort_all()
    assert all(r.finish_reason == "abort" for r in running.result(timeout=60) + queued.result(timeout=60))
    assert not scheduler.pauses.paused
    # Rows queued after the abort run as usual.
    assert scheduler.run([RowRequest(prompt_ids=[5], max_new_tokens=2)], timeout=60)[0].finish_reason == "length"
    scheduler.stop()
