"""The model runner, driven through the trainer's EmbeddedEngine, against an independent HF forward:
lengths, stops, log-probs, seeds, weight loads, memory release."""

import pytest
import torch

from megaopd.engine.config import EmbeddedEngineConfig
from megaopd.engine.memory import EngineReleasedError
from megaopd.engine.weights import WeightMismatchError
from megaopd.rollout.embedded import EmbeddedEngine
from megaopd.rollout.protocol import SamplingParams
from tests.engine._models import EOS, hf_logprobs, random_state_dict

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3] * 12, [40, 41, 42]]


def max_logprob_gap(model_dir_or_model, samples, temperature):
    gap = 0.0
    for s in samples:
        ref = hf_logprobs(model_dir_or_model, s.prompt_ids, s.output_ids, temperature)
        gap = max(gap, (ref - torch.tensor(s.output_logprobs, dtype=torch.float64)).abs().max().item())
    return gap


def test_max_new_tokens_and_length(engine):
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=7, temperature=1.0, ignore_eos=True, seed=0))
    assert len(samples) == len(PROMPTS)
    for p, s in zip(PROMPTS, samples):
        assert s.prompt_ids == p
        assert len(s.output_ids) == len(s.output_logprobs) == 7
        assert s.finish_reason == "length"
        assert s.weight_version == "default"


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1), (1.3, 1.0, 5)])
def test_logprobs_match_independent_hf_forward(engine, tiny_dir, temperature, top_p, top_k):
    # Left-padded prompts of different lengths, n samples sharing a prefill, rows leaving the batch.
    samples = engine.generate(
        PROMPTS,
        SamplingParams(
            n=3, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=11, stop_token_ids=[7, 13]
        ),
    )
    assert max_logprob_gap(tiny_dir, samples, temperature) < 1e-5  # float32 round-off


def test_eos_finishes_stop_and_is_kept(eos_dir):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=eos_dir))
    samples = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=30, seed=0))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "the EOS-biased model should stop"
    for s in samples:
        if s.finish_reason == "stop":
            assert s.output_ids[-1] == EOS and EOS not in s.output_ids[:-1]
        else:
            assert len(s.output_ids) == 30 and EOS not in s.output_ids
    assert max_logprob_gap(eos_dir, samples, 1.0) < 1e-4
    # ignore_eos keeps going to the budget.
    long = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=30, seed=0, ignore_eos=True))
    assert all(s.finish_reason == "length" and len(s.output_ids) == 30 for s in long)


def test_stop_token_id(engine):
    free = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = free.output_ids[5]
    first = free.output_ids.index(stop_id)
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[stop_id])
    )[0]
    assert stopped.finish_reason == "stop"
    end = min(first, free.output_ids.index(EOS) if EOS in free.output_ids else first)  # EOS stops too
    assert stopped.output_ids == free.output_ids[: end + 1]
    # SGLang 0.5.23: ignore_eos ignores stop_token_ids as well (seen against its server, tests/e2e/sglang).
    ignored = engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert ignored.output_ids == free.output_ids and ignored.finish_reason == "length"


def test_seed_determinism_and_batch_independence(engine):
    params = SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=123)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.output_logprobs for s in a] == [s.output_logprobs for s in b]
    # Prompt 2 alone, told its index in the batch, draws the same samples.
    alone = engine.generate(PROMPTS[2:3], params, first_prompt_index=2)
    assert [s.output_ids for s in alone] == [s.output_ids for s in a[6:9]]
    # n samples of one prompt differ from each other; another seed gives other samples.
    assert len({tuple(s.output_ids) for s in a[:3]}) > 1
    c = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=124))
    assert [s.output_ids for s in c] != [s.output_ids for s in a]


def test_chunks_beyond_max_batch_size(engine):
    # max_batch_size is 16 in the fixture: 4 prompts x n=5 = 20 rows run as two chunks.
    params = SamplingParams(n=5, max_new_tokens=4, seed=5)
    many = engine.generate(PROMPTS, params)
    assert len(many) == 20
    one = engine.generate(PROMPTS[3:], params, first_prompt_index=3)
    assert [s.output_ids for s in one] == [s.output_ids for s in many[15:]]


def test_update_weights_changes_logprobs_and_rejects_mismatches(tiny_dir):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir))
    params = SamplingParams(n=2, max_new_tokens=8, seed=9)
    before = engine.generate(PROMPTS, params)
    new = random_state_dict(tiny_dir, seed=42)

    bad = dict(new)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    bad["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(WeightMismatchError) as err:
        engine.update_weights(bad.items(), weight_version="bad")
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight: shape [3, 3] != model's [128, 64]" in msg
    assert "model.layers.9.self_attn.q_proj.weight: no such weight" in msg
    assert engine.weight_version == "default"
    unchanged = engine.generate(PROMPTS, params)
    assert [s.output_logprobs for s in unchanged] == [s.output_logprobs for s in before]  # nothing loaded

    engine.update_weights(new.items(), weight_version="v1")
    after = engine.generate(PROMPTS, params)
    assert all(s.weight_version == "v1" for s in after)
    from transformers import Qwen2ForCausalLM

    ref = Qwen2ForCausalLM(engine.model.config).float()
    ref.load_state_dict(new)
    assert max_logprob_gap(ref.eval(), after, 1.0) < 1e-4
    # The old model's log-probs of the new samples differ (the update took effect).
    assert max_logprob_gap(tiny_dir, after, 1.0) > 1e-2


def test_release_discard_resume_requires_reload(tiny_dir):
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, release_weights="discard"))
    params = SamplingParams(max_new_tokens=5, seed=1)
    before = engine.generate(PROMPTS, params)
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    engine.release_memory()
    assert not engine.health()
    assert engine.model.model.embed_tokens.weight.numel() == 0  # storage freed
    with pytest.raises(EngineReleasedError, match="resume_memory"):
        engine.generate(PROMPTS, params)
    engine.resume_memory()
    with pytest.raises(EngineReleasedError, match="update_weights"):
        engine.generate(PROMPTS, params)
    engine.update_weights(state.items())
    again = engine.generate(PROMPTS, params)
    assert [s.output_ids for s in again] == [s.output_ids for s in before]


def test_release_keep_on_cpu(engine):
    engine.release_memory(["kv_cache"])
    with pytest.raises(EngineReleasedError):
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    engine.resume_memory(["kv_cache"])
    engine.release_memory()
    engine.resume_memory()
    assert engine.health()
    assert len(engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].output_ids) == 2
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["gpu"])


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 500]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=600))


def test_continuous_batching_rows_match_alone(eos_dir):
    """More rows than slots, mixed budgets, some ending on EOS: each row's tokens and log-probs are those
    it gets alone (a finished row's slot goes to a waiting row; a row's draws are its own)."""
    from megaopd.engine.rows import RowRequest

    eng = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=eos_dir, max_batch_size=3))
    rows = [
        RowRequest(
            prompt_ids=[3 + i, 5, 7 + 2 * i][: 1 + i % 3],
            max_new_tokens=4 + 5 * (i % 4),
            stop_ids=frozenset({EOS}) if i % 2 else frozenset(),
            seed=100 + i,
            top_p=0.9 if i == 5 else 1.0,
        )
        for i in range(10)
    ]
    together = eng.run(rows)
    assert len(together) == 10 and eng._cache.slots == 3
    for r, t in zip(rows, together):
        alone = eng.run([r])[0]
        assert t.output_ids == alone.output_ids and t.finish_reason == alone.finish_reason
        assert t.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert len(t.output_ids) <= r.max_new_tokens
        if t.finish_reason == "length":
            assert len(t.output_ids) == r.max_new_tokens
    assert any(t.finish_reason == "stop" for t in together)


def test_sync_every_keeps_results(tiny_dir):
    """Reading the finished flags every 5 steps (the CUDA default is 8) gives the same rows as every step."""
    from megaopd.engine.rows import RowRequest

    rows = [
        RowRequest(prompt_ids=[4, 9, i + 3], max_new_tokens=3 + 4 * i, stop_ids=frozenset({EOS, 11}), seed=i)
        for i in range(7)
    ]
    a = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4)).run(rows)
    b = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4, sync_every=5)).run(rows)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


def test_retract_after_every_row_finished_between_harvests(tiny_dir):
    """With the finished flags read every 16 steps (the CUDA path reads every 8), a retract at each step
    boundary finds rows that finished since the last harvest, and at last none running: each row still
    ends as it does without retracts (same tokens; log-probs recomputed by the re-prefill within
    round-off) and the run returns rather than sampling from nothing."""
    from megaopd.engine.decode import decode_rows
    from megaopd.engine.rows import RowRequest

    rows = [
        RowRequest(prompt_ids=[4, 9, i + 3], max_new_tokens=2 + i, stop_ids=frozenset({EOS}), seed=i) for i in range(3)
    ]
    eng = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4, sync_every=16))
    plain = eng.run(rows)
    retracted = decode_rows(eng._decoder(rows), rows, "v", lambda: "retract", sync_every=16)
    assert [r.output_ids for r in retracted] == [r.output_ids for r in plain]
    assert [r.finish_reason for r in retracted] == [r.finish_reason for r in plain]
    for a, b in zip(retracted, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_context_length_sizes_the_cache_and_a_longer_row_grows_it(tiny_dir):
    """context_length (set by the trainer to its longest generated row) sizes the static KV cache as `megaopd
    plan` counts it (cache_positions), instead of what mem_fraction_static would leave on a GPU; a row past
    it reallocates the cache and still decodes the same tokens."""
    from megaopd.engine.config import cache_positions
    from megaopd.engine.rows import RowRequest

    rows = [RowRequest(prompt_ids=[4, 9, 3], max_new_tokens=6, seed=1)]
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=2, context_length=200))
    first = engine.run(rows)
    assert engine._cache.capacity == cache_positions(200, engine.sync_every) == 256
    long = [RowRequest(prompt_ids=[4, 9, 3], max_new_tokens=300, seed=1)]
    assert engine.run(long)[0].output_ids[:6] == first[0].output_ids
    assert engine._cache.capacity == cache_positions(303, engine.sync_every) == 384
    with pytest.raises(ValueError, match="context_length"):
        EmbeddedEngineConfig(hf_dir=tiny_dir, context_length=-1)


@pytest.mark.slow  # a compilation of the decode step: ~30 s on 2 cores
def test_compiled_decode_keeps_rows(tiny_dir):
    """compile_decode: the same rows as the eager step (tokens, finish reasons, log-probs to 1e-5). Rows of
    several lengths, in 4 slots down to 2 rows (a batch of one row would compile a second time)."""
    from megaopd.engine.rows import RowRequest

    rows = [RowRequest(prompt_ids=[4, 9, i + 3], max_new_tokens=6 + 4 * (i % 2), seed=i) for i in range(4)]
    a = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4)).run(rows)
    b = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4, compile_decode=True)).run(rows)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_admit_min_batches_admissions_and_keeps_rows(tiny_dir, monkeypatch):
    """admit_min=3: waiting rows enter only when 3 slots are free (or all of them fit): fewer prefills, the
    same rows (a row's tokens are its own whenever it starts)."""
    from megaopd.engine import decode
    from megaopd.engine.rows import RowRequest

    prefills = []
    real = decode._prefill
    monkeypatch.setattr(decode, "_prefill", lambda *a: prefills.append(len(a[4])) or real(*a))
    rows = [RowRequest(prompt_ids=[4, 9, i + 3], max_new_tokens=2 + 3 * (i % 5), seed=i) for i in range(12)]
    results, by_one = {}, []
    for admit in (1, 3):
        prefills.clear()
        # sync_every=1 (the CPU's): on CUDA's 8, rows finish between harvests in fours and both values admit alike
        results[admit] = EmbeddedEngine(
            EmbeddedEngineConfig(hf_dir=tiny_dir, max_batch_size=4, admit_min=admit, sync_every=1)
        ).run(rows)
        counts = list(prefills)
        assert sum(counts) == len(rows)
        if admit == 3:  # every admission but the last (the rows left) fills >= 3 slots, and there are fewer
            assert all(n >= 3 for n in counts[:-1]) and len(counts) < len(by_one), (counts, by_one)
        by_one = counts
    assert [r.output_ids for r in results[1]] == [r.output_ids for r in results[3]]
    for a, b in zip(results[1], results[3]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
