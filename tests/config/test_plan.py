"""`megaopd plan`: per-GPU memory against hand-computed sizes of a 7B student and against a measurement.

Hand computation for Qwen2.5-7B (fixtures/qwen2.5-math-7b/config.json, the real dims: h=3584, 28 heads of
128, 4 KV heads, FFN 18944, 28 layers, vocab 152064, untied) at TP=2:
  per layer, split over TP: q,k,v weight 3584*(3584+2*512)=16,515,072 + bias 4,608, o 3584*3584=12,845,056,
    MLP 3*3584*18944=203,685,888 -> 233,050,624 / 2 = 116,525,312; plus two RMSNorm weights 2*3584 whole
    -> 116,532,480 per rank per layer, x28 = 3,262,909,440
  embedding and output layer: 152064 (already a multiple of 128*2) * 3584 / 2 = 272,498,688 each
  final norm 3584 -> 3,807,910,400 parameters per rank (the full model: 7,615,616,512, Qwen2.5-7B's 7.6B)
  bf16 weights 2 B/param = 7,615,820,800 B; fp32 gradients 4 B/param = 15,231,641,600 B;
  Adam fp32 master + m + v = 12 B/param = 45,694,924,800 B, /4 with the distributed optimizer at
  8 GPUs (DP = 8/2 = 4) = 11,423,731,200 B.
"""

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from megaopd.config.plan import EngineMemory, MachineMemory, PlanRoles, StepLayout, build_plan, explain_overflow
from megaopd.config.plan_shape import StepRows, train_shape
from megaopd.config.plan_sizes import (
    OPS_CHUNK_BYTES,
    OPS_CHUNKS_LIVE,
    RoleLayout,
    activation_bytes,
    embedded_engine_footprint,
    hidden_bytes,
    logits_bytes,
    params_per_rank,
)
from megaopd.models.hf_config import read_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
Q7B = os.path.join(FIXTURES, "qwen2.5-math-7b")
Q15B = os.path.join(FIXTURES, "qwen2.5-math-1.5b")


def _build(student, reference, teacher, **kw):
    """build_plan from these tests' keywords, each handed to the record that holds it."""

    def take(record):
        return record(**{f.name: kw.pop(f.name) for f in fields(record) if f.name in kw})

    step, machine, engines = take(StepLayout), take(MachineMemory), take(EngineMemory)
    assert not kw, f"no record holds {sorted(kw)}"
    return build_plan(PlanRoles(student, reference, teacher), step, machine, engines)


def _role(path, tp=2, dtype="bfloat16", **kw):
    return RoleLayout("student", read_hf_config(path), tp, 1, dtype, **kw)


def _plan(student, **kw):
    args = dict(
        world_size=8,
        micro_batch_rows=1,
        seq_len=4096,
        use_distributed_optimizer=True,
        colocated=False,
        gpu_memory_gb=141,
        engine_memory_fraction=0.5,
        engine_released_gb=3,
        reserved_gb=5,
        flash_attention=True,
    )
    args.update(kw)
    return _build(student, None, None, **args)


def _item(plan, prefix):
    (item,) = [i for i in plan.items if i.name.startswith(prefix)]
    return item


def test_7b_tp2_weights_gradients_adam_by_hand():
    student = _role(Q7B)
    assert params_per_rank(student.hf, 1, 1) == 7_615_616_512
    assert params_per_rank(student.hf, 2, 1) == 3_807_910_400
    plan = _plan(student)
    assert _item(plan, "student weights").train == 7_615_820_800
    assert _item(plan, "student gradients").train == 15_231_641_600
    assert _item(plan, "Adam states").train == 11_423_731_200
    plain = _plan(student, use_distributed_optimizer=False)
    assert _item(plain, "Adam states").train == 45_694_924_800


def test_7b_activations_by_hand_and_the_issue_estimate():
    student = _role(Q7B)
    # one layer, 8 x 4096 tokens, bf16, TP=2, no SP, flash: 2 B * 32768 * (4*3584 [two norms' inputs, the qkv
    # and fc1 inputs] + 4*128 [RoPE's cos/sin] + (2*3584 [q, attention output] + 2*512 [k, v] + 5*18944 [fc1's
    # output, three [t, f] of the activation]) / 2)
    per_layer = 2 * 32768 * (4 * 3584 + 4 * 128 + (2 * 3584 + 2 * 512 + 5 * 18944) / 2)
    assert activation_bytes(student, 8, 4096, True) == pytest.approx(28 * per_layer)
    # The issue's "about 100 GB of activations at 8 x 4096 at TP=2" (the same order).
    assert 50e9 < 28 * per_layer < 150e9
    sp = _role(Q7B, sequence_parallel=True)
    assert activation_bytes(sp, 8, 4096, True) == pytest.approx(
        28 * 2 * 32768 * ((6 * 3584 + 2 * 512 + 5 * 18944) / 2 + 4 * 128)
    )
    full = _role(Q7B, recompute="full")
    assert activation_bytes(full, 8, 4096, True) == pytest.approx(28 * 2 * 32768 * 3584 + per_layer)
    # vocab-parallel logits: 32768 tokens x 152064/2 x 2 B
    assert logits_bytes(student, 8, 4096) == 32768 * 76032 * 2


def test_layer_activations_match_what_megatron_saves(tmp_path):
    """The plan's per-token parts against the bytes a megatron layer (megaopd's local spec, bf16, packed THD)
    hands to autograd, counted with saved-tensor hooks per module (one storage counted once), for the parts
    that run the same code on CPU as on a GPU without Transformer Engine: the attention linears' inputs,
    RoPE's cos/sin and the MLP. The norms and the core attention run CPU composites here (float32 copies,
    the scores of torch's math attention), so they are left to the GPU check's trainer bench."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megaopd.config.plan_sizes import layer_saved_elements
    from megaopd.models.builder import BuildOptions, build_gpt_model
    from megaopd.parallel.dist import init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    dims = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(dims))
    cfg = read_hf_config(str(tmp_path))
    init_distributed()
    model = build_gpt_model(cfg, Layout(), initialize_actor_layout(Layout(1, 1)), BuildOptions(dtype=torch.bfloat16))
    lens = [40, 24, 32]
    tokens = sum(lens)
    cu = torch.tensor([0, 40, 64, 96], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40, max_seqlen_kv=40)
    layer = model.decoder.layers[0]
    where = ["outside"]
    for name, module in layer.named_modules():
        module.register_forward_pre_hook(lambda m, a, n=name: where.append(n))
        module.register_forward_hook(lambda m, a, o: where.pop() and None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[str, int]] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in saved:
            saved[key] = (where[-1], t.untyped_storage().nbytes())
        return t

    hidden = (
        model.embedding(
            input_ids=torch.randint(0, 512, (1, tokens)), position_ids=torch.cat([torch.arange(n) for n in lens])[None]
        )
        .detach()
        .requires_grad_()
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(
            hidden_states=hidden,
            attention_mask=None,
            rotary_pos_emb=model.rotary_pos_emb(40, packed_seq=True),
            packed_seq_params=packed,
        )

    def measured(*modules):
        return sum(n for m, n in saved.values() if m in modules) / (2 * tokens)  # bf16 elements per token

    parts = {name.split(" ")[0]: v for name, v in layer_saved_elements(cfg, 1, False).items()}
    d = cfg.head_dim
    assert measured("mlp", "mlp.linear_fc1", "mlp.linear_fc2") == parts["MLP"]
    assert measured("self_attention.linear_qkv", "self_attention.linear_proj") == parts["attention"]
    assert measured("self_attention") == 4 * d  # RoPE's cos/sin; q, k, v are the core attention's to keep
    assert parts["q,"] == 64 + 2 * 32 + 4 * d


def test_overflow_names_the_biggest_items_and_the_fix():
    plan = _plan(_role(Q7B), micro_batch_rows=8, seq_len=9216, use_distributed_optimizer=False)
    assert not plan.fits()
    msg = explain_overflow(plan)
    assert "train phase" in msg and "student activations" in msg and "recompute=full" in msg
    assert "use_distributed_optimizer=true" in msg
    fixed = _plan(_role(Q7B, recompute="full", sequence_parallel=True), micro_batch_rows=1, seq_len=9216)
    assert fixed.fits()


def test_packed_micro_batch_is_the_token_budget():
    """With trainer.pack_sequences=true a forward holds max_tokens_per_micro_batch tokens, whatever
    micro_batch_size is: the GPU check's 1.5B shape at 16384 tokens, by hand."""
    student = _role(Q15B, tp=1)
    reference = RoleLayout("reference", student.hf, 1, 1, "bfloat16")
    tokens, V = 16384, 151936  # 151936 = 1187 * 128: no vocabulary padding at TP=1
    L = tokens * V * 2  # one bf16 logits tensor of the micro-batch: 4.98e9 bytes, the H100 OOM's "4.63 GiB"
    assert L / 2**30 == pytest.approx(4.64, abs=0.01)
    chunks = OPS_CHUNKS_LIVE * OPS_CHUNK_BYTES
    for rows in (1, 8):  # micro_batch_size is not read on the packed path
        plan = _build(
            student,
            reference,
            None,
            world_size=1,
            micro_batch_rows=rows,
            seq_len=384,
            use_distributed_optimizer=True,
            colocated=False,
            gpu_memory_gb=80,
            engine_memory_fraction=0.5,
            engine_released_gb=3,
            reserved_gb=5,
            flash_attention=True,
            packed_tokens=tokens,
        )
        # training: the student's logits and the reference's, whose memory then takes the student's gradient
        # (2L), plus the ops' float32 chunks; no float32 or concatenated copy of the logits
        assert _item(plan, "student logits").train == L + chunks
        assert _item(plan, "reference logits").train == L
        assert _item(plan, "student activations").train == activation_bytes(student, 1, tokens, True)
        assert "16384 tokens packed" in _item(plan, "student activations").name
    # unfused attention: scores only within each sequence (<= 384 keys), not 16384 x 16384
    e, heads = 2, 12
    full_seq = activation_bytes(student, 1, tokens, False)
    within = activation_bytes(student, 1, tokens, False, attn_seq=384)
    assert full_seq - within == pytest.approx(28 * 2 * e * heads * tokens * (tokens - 384))
    # the largest micro-batch: what the rows fill of the budget, or one unit longer than it (a sequence, a
    # GRPO group kept whole)
    rows = dict(rollout_rows=64, golden_rows=0, golden_tokens=0, mini_batches=1, micro_batch_size=1)
    assert train_shape(StepRows(rollout_tokens=384, group=1, max_tokens=16384, **rows), 1).tokens == 42 * 384
    assert train_shape(StepRows(rollout_tokens=9216, group=4, max_tokens=16384, **rows), 1).tokens == 4 * 9216
    assert train_shape(StepRows(rollout_tokens=9216, group=1, max_tokens=4096, **rows), 1).tokens == 9216
    # no reference (opd alone): the logits and a gradient buffer of their own
    alone = _build(
        student,
        None,
        None,
        world_size=1,
        micro_batch_rows=1,
        seq_len=384,
        use_distributed_optimizer=True,
        colocated=False,
        gpu_memory_gb=80,
        engine_memory_fraction=0.5,
        engine_released_gb=3,
        reserved_gb=5,
        flash_attention=True,
        packed_tokens=tokens,
    )
    assert _item(alone, "student logits").train == 2 * L + chunks
    # padded rows (pack_sequences=false, 8 x 384): the loss's logits[:, :-1] of several rows is copied by the
    # ops, for each model (benchmarks/memory.py "train, padded": 4.5L)
    padded = _build(
        student,
        reference,
        None,
        world_size=1,
        micro_batch_rows=8,
        seq_len=384,
        use_distributed_optimizer=True,
        colocated=False,
        gpu_memory_gb=80,
        engine_memory_fraction=0.5,
        engine_released_gb=3,
        reserved_gb=5,
        flash_attention=True,
    )
    L8 = 8 * 384 * V * 2
    assert _item(padded, "student logits").train == 2 * L8 + chunks
    assert _item(padded, "reference logits").train == 2 * L8


def test_fused_output_layer_and_what_nvidia_smi_shows_by_hand():
    """trainer.logits_chunk_tokens=1024 at the GPU check's 1.5B shape, 16384 tokens packed: per model one
    1024-token chunk of logits instead of the micro-batch's; the student's chunk gradient in the reference
    chunk, the ops' float32 chunks, the weight's float32 gradient + one bf16 product, and the hidden states
    (output, megatron's transposed copy, gradient). Then the CUDA context, the allocator's reserve and the
    embedded engine (fp32 weights resident unless colocated, KV cache while generating)."""
    student = _role(Q15B, tp=1)
    reference = RoleLayout("reference", student.hf, 1, 1, "bfloat16")
    tokens, V, h = 16384, 151936, 1536
    engine = embedded_engine_footprint(student.hf, "float32", 64, 384, colocated=False)
    # 1.5B: 28 layers, 2 KV heads of 128; the whole model in float32, tied embeddings (one vocabulary matrix)
    assert engine.kv_cache == 2 * 28 * 2 * 128 * 4 * 64 * 384 + 4 * 64 * V
    assert engine.weights == 4 * params_per_rank(student.hf, 1, 1)
    kw = dict(
        world_size=1,
        micro_batch_rows=1,
        seq_len=384,
        use_distributed_optimizer=True,
        colocated=False,
        gpu_memory_gb=80,
        engine_memory_fraction=0.5,
        engine_released_gb=3,
        reserved_gb=0,
        flash_attention=True,
        packed_tokens=tokens,
    )
    plan = _build(
        student,
        reference,
        None,
        logits_chunk_tokens=1024,
        cuda_context_gb=0.6,
        allocator_reserve=0.1,
        embedded_engine=engine,
        **kw,
    )
    lc, hid = 1024 * V * 2, tokens * h * 2
    assert hidden_bytes(student, tokens) == hid
    assert _item(plan, "student logits (fused").train == lc + OPS_CHUNKS_LIVE * OPS_CHUNK_BYTES + 6 * V * h + 3 * hid
    assert _item(plan, "reference logits (fused").train == lc + hid
    assert _item(plan, "embedded engine").generate == engine.weights + engine.kv_cache
    # not colocated: weights and KV cache resident while training (the engine keeps its static cache)
    assert _item(plan, "embedded engine").train == engine.weights + engine.kv_cache
    assert _item(plan, "CUDA context").train == 0.6e9
    assert plan.total("train") == pytest.approx(1.1 * plan.allocated("train"))
    whole = _build(student, reference, None, cuda_context_gb=0.6, allocator_reserve=0.1, embedded_engine=engine, **kw)
    assert whole.allocated("train") - plan.allocated("train") > 7e9  # 2L (10 GB) less, 2.6 GB of chunks etc. more
    colocated = _build(
        student,
        reference,
        None,
        logits_chunk_tokens=1024,
        embedded_engine=embedded_engine_footprint(student.hf, "float32", 64, 384, True),
        **kw,
    )
    assert _item(colocated, "embedded engine").train == 0.0  # weights offloaded, KV cache released


def test_gpu_check_shape_names_the_budget_and_recompute():
    """The H100 trainer bench (1.5B student/reference/teacher, 16 x 4 x 256 new tokens, packed 16384-token
    micro-batches): recompute=none ran out of memory there; the plan refuses it naming what to lower, and
    passes recompute=full or a smaller token budget."""
    yaml_path = os.path.join(ROOT, "scripts", "gpu_check", "stable_opd_gpu.yaml")
    common = [
        f"student.path={Q15B}",
        f"teacher.path={Q15B}",
        "trainer.prompts_per_step=16",
        "trainer.samples_per_prompt=4",
        "rollout.max_new_tokens=256",
        "plan.gpu_memory_gb=80",
        "rollout.engine_dtype=auto",
    ]  # as the GPU check's trainer bench runs it (the YAML pins float32)
    bad = _cli("plan", yaml_path, *common, "student.recompute=none")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    # 64 rollout rows and 16 golden rows of 384 tokens (the budgets): 42 of them fill the 16384-token budget
    assert "16128 tokens packed" in bad.stdout
    assert "student.recompute=full" in bad.stderr and "trainer.max_tokens_per_micro_batch" in bad.stderr
    assert _cli("plan", yaml_path, *common, "student.recompute=full").returncode == 0
    smaller = _cli("plan", yaml_path, *common, "student.recompute=none", "trainer.max_tokens_per_micro_batch=4096")
    assert smaller.returncode == 0, smaller.stdout + smaller.stderr
    assert "3840 tokens packed" in smaller.stdout  # 10 rows of 384 in 4096
    padded = _cli("plan", yaml_path, *common, "student.recompute=none", "trainer.pack_sequences=false")
    # micro_batch_size=8 rows of 128 + 256 tokens, and 2 of the 16 golden rows spread over the 8 micro-batches
    assert "10 x 384 tokens" in padded.stdout
    # recompute=none at the 16384-token budget does not fit on an 80 GB GPU (the H100 ran out of memory in the
    # first micro-batch's forward: megatron's local layers keep ~72 h bytes a token and layer);
    # half the budget does, with the colocated engine's weights off the GPU while training.
    fused = ["student.recompute=none", "rollout.colocated=true", "plan.reserved_gb=0"]
    assert _cli("plan", yaml_path, *common, *fused).returncode == 1
    assert _cli("plan", yaml_path, *common, *fused, "trainer.max_tokens_per_micro_batch=8192").returncode == 0


def _write_preset(tmp_path, **sections):
    import yaml

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2", "golden": "2"}) + "\n")
    cfg = {
        "run": {"world_size": 8},
        "student": {"path": Q7B, "tp": 2, "dtype": "bfloat16"},
        "reference": {"tp": 2, "dtype": "bfloat16"},
        "teacher": {"path": os.path.join(FIXTURES, "openthinker3-7b"), "tp": 2, "dtype": "bfloat16"},
        "data": {"sources": [{"path": str(data)}], "max_prompt_len": 1024, "max_golden_len": 3072},
        "rollout": {"max_new_tokens": 3072},
        "loss": {"name": "stable_opd"},
        # rows of the paper's 9216 tokens, planned without extending the fixture's 4096 positions
        "plan": {"max_tokens": 9216},
        "trainer": {"micro_batch_size": 1},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "megaopd.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_plan_command_exit_status(tmp_path):
    preset = _write_preset(tmp_path)
    ok = _cli("plan", preset, "student.recompute=full", "optimizer.use_distributed_optimizer=true")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "student weights" in ok.stdout and "teacher weights" in ok.stdout and "reference weights" in ok.stdout
    assert "fits: peak" in ok.stdout
    bad = _cli("plan", preset, "trainer.pack_sequences=false", "trainer.micro_batch_size=8", "plan.gpu_memory_gb=80")
    assert bad.returncode == 1
    assert "does not fit" in bad.stderr and "student activations" in bad.stderr
    assert _cli("plan", preset, "plan.attention=sdpa").returncode == 2


# ------------------------------------------------------------------------------- the job's rows, the device
TINY = os.path.join(ROOT, "examples", "tiny")


def _load(preset, *overrides):
    from megaopd.config import load_config
    from megaopd.config.schema import MegaOPDConfig

    return load_config(MegaOPDConfig, os.path.join(TINY, preset), list(overrides))


def test_plan_counts_the_jobs_rows_not_the_token_budget(monkeypatch):
    """2 prompts x 1 sample of 50 + 50 tokens (opd: no golden rows) at world 1: the step holds 200 tokens and
    the plan's micro-batch is those 200 tokens, not trainer.max_tokens_per_micro_batch=16384 (the issue's
    33.3 GB plan of an 11.4 GB run). Mini-batches and data parallelism divide the rows as the trainer does."""
    from megaopd.config.plan import plan_for

    monkeypatch.chdir(ROOT)
    small = (
        "run.world_size=1",
        "student.tp=1",
        "reference.tp=1",
        "trainer.prompts_per_step=2",
        "trainer.samples_per_prompt=1",
        "data.max_prompt_len=50",
        "rollout.max_new_tokens=50",
        "plan.device=cpu",
    )
    plan = plan_for(_load("opd.yaml", *small))
    acts = _item(plan, "student activations")
    assert "200 tokens packed" in acts.name and "16384" not in plan.notes[0]
    student = RoleLayout("student", read_hf_config(os.path.join(TINY, "models", "student")), 1, 1, "float32", cpu=True)
    assert acts.train == activation_bytes(student, 1, 200, True, attn_seq=100)
    assert (
        "100 tokens packed"
        in _item(plan_for(_load("opd.yaml", *small, "trainer.mini_batches_per_step=2")), "student activations").name
    )
    dp2 = plan_for(_load("opd.yaml", *small, "run.world_size=2"))  # tp 1 at world 2: each replica 1 row
    assert "100 tokens packed" in _item(dp2, "student activations").name
    # The rows fill the budget: 128 rows of 256 tokens and 32 golden rows of 384 (stable_opd) at world 2, TP 2.
    demo = plan_for(_load("stable_opd.yaml", "plan.device=cpu"))
    assert "16384 tokens packed" in _item(demo, "student activations").name


def test_a_reference_teacher_is_not_a_second_model_and_its_longer_rows_are_scored(monkeypatch):
    """self_distill.yaml's teacher is the reference model shown the golden solution: with a loss that loads the
    reference (ref_kl) the teacher runs on it, and the plan counts no teacher weights; with plain opd (no
    reference) the trainer loads it as a model of its own, and the plan counts it. Its rows are longer than the
    student's by the golden budget: the scoring pass is sized for them."""
    from megaopd.config.plan import plan_for

    monkeypatch.chdir(ROOT)
    ref_kl = ("loss.name=stable_opd", "loss.config={sft_weight: 0.1, ref_kl_weight: 0.01}", "plan.device=cpu")
    shared = plan_for(_load("self_distill.yaml", *ref_kl))
    assert not [i for i in shared.items if i.name.startswith("teacher weights")]
    assert [i for i in shared.items if i.name.startswith("reference weights")]
    own = plan_for(_load("self_distill.yaml", "plan.device=cpu"))
    assert [i for i in own.items if i.name.startswith("teacher weights")]
    # Padded rows (no packing): a scoring micro-batch is micro_batch_size rows of the longest row's tokens.
    padded = ("trainer.pack_sequences=false", "plan.device=cpu")
    with_context = _item(plan_for(_load("self_distill.yaml", *padded)), "scoring pass")
    without = _item(plan_for(_load("self_distill.yaml", *padded, 'teacher.context=""')), "scoring pass")
    assert with_context.score > without.score


def test_cpu_plan_has_the_cpus_items_only(monkeypatch):
    """plan.device=cpu: no CUDA context, NCCL margin, allocator reserve or offloading (offload_between_uses
    moves nothing on a CPU); the rank process instead, and the machine's memory shared by the ranks. auto
    follows the dtypes (bf16/fp16: a GPU job) and, for float32, this machine."""
    import torch

    from megaopd.config.plan import plan_device, plan_for

    monkeypatch.chdir(ROOT)
    offload = ("reference.offload_between_uses=true", "teacher.offload_between_uses=true")
    cpu = plan_for(_load("stable_opd.yaml", "plan.device=cpu", "plan.cpu_memory_gb=16", *offload))
    names = " | ".join(i.name for i in cpu.items)
    assert "CUDA context" not in names and "reserved" not in names and "offloaded" not in names
    assert _item(cpu, "rank process").train == 0.75e9
    assert _item(cpu, "reference weights").generate == _item(cpu, "reference weights").train > 0
    assert cpu.total("train") == cpu.allocated("train")  # no caching allocator's reserve
    engine = _item(cpu, "embedded engine").peak()
    assert cpu.needed() == pytest.approx(2 * cpu.peak() - engine)  # rank 0 with the engine, rank 1 without
    assert cpu.fits() and "per rank process" in cpu.summary() and cpu.gpu_bytes == 16e9
    gpu = plan_for(_load("stable_opd.yaml", "plan.device=cuda", *offload))
    assert _item(gpu, "CUDA context").train == 0.6e9 and _item(gpu, "reserved").train == 5e9
    assert _item(gpu, "reference weights (offloaded)").generate == 0
    assert gpu.total("train") == pytest.approx(1.1 * gpu.allocated("train"))
    assert plan_device(_load("stable_opd.yaml", "student.dtype=bfloat16", "reference.dtype=bfloat16")) == "cuda"
    assert plan_device(_load("stable_opd.yaml")) == ("cuda" if torch.cuda.is_available() else "cpu")
    out = _cli("plan", os.path.join(TINY, "stable_opd.yaml"), "plan.device=cpu")
    assert out.returncode == 0 and "per rank process" in out.stdout and "CUDA" not in out.stdout, out.stdout


def test_multi_turn_rows_are_planned_at_the_trajectory_budget(monkeypatch):
    """examples/tiny/agentic.yaml: trajectories reach 240 tokens after the 128-token prompt, not the 96 of one
    turn: the training micro-batch holds 16 rows of 368 + 8 golden rows of 384, the scoring one the teacher's
    share (TP 1 at world 2: 8 rows), the engine's cache 368 positions; --step-time's longest response 240."""
    from megaopd.config.plan import plan_for
    from megaopd.config.step_time import shape_for

    monkeypatch.chdir(ROOT)
    cfg = _load("agentic.yaml", "plan.device=cpu")
    assert cfg.rollout_row_tokens() == cfg.generated_row_tokens() == 128 + 240
    plan = plan_for(cfg)
    assert f"micro-batch {16 * 368 + 8 * 384} tokens packed (scoring: {16 * 368} tokens packed)" in plan.notes[0]
    shape = shape_for(cfg)
    assert (shape.longest, shape.response_tokens) == (240, 120)


def test_rows_are_shared_and_packed_as_the_trainer_does():
    """plan_shape against the trainer's rules: GRPO groups stay whole, golden rows pack beside rollouts, DP
    shares are balanced, padded micro-batches carry their share of the golden rows."""
    from megaopd.config.plan_shape import score_shape

    r = StepRows(
        rollout_rows=128,
        rollout_tokens=256,
        golden_rows=32,
        golden_tokens=384,
        group=1,
        mini_batches=1,
        max_tokens=16384,
        micro_batch_size=8,
    )
    assert train_shape(r, 1).tokens == 16384  # 32 x 384 + 16 x 256 fill it exactly
    assert train_shape(r, 4).tokens == (128 * 256 + 32 * 384) // 4  # 11264: a quarter each, under the budget
    assert score_shape(r, 2).tokens == 64 * 256 and score_shape(r, 1).tokens == 64 * 256  # budget-bound
    groups = StepRows(
        rollout_rows=8,
        rollout_tokens=300,
        golden_rows=0,
        golden_tokens=0,
        group=4,
        mini_batches=1,
        max_tokens=1000,
        micro_batch_size=8,
    )
    assert train_shape(groups, 1).tokens == 1200  # a group of 4 x 300 is one unit, over the budget
    padded = StepRows(
        rollout_rows=64,
        rollout_tokens=384,
        golden_rows=16,
        golden_tokens=512,
        group=1,
        mini_batches=2,
        max_tokens=0,
        micro_batch_size=8,
    )
    shape = train_shape(padded, 2)  # 16 rows and 4 golden rows per rank: 2 micro-batches of 8 + 2, 512 wide
    assert (shape.rows, shape.tokens, shape.packed) == (10, 512, False)


# --------------------------------------------------------------------------------------- measurement
@pytest.mark.slow
def test_activations_and_logits_match_a_cpu_measurement(tmp_path):
    """The bytes one float32 forward leaves allocated while its graph is kept (what backward needs) against
    the plan's activations + logits for megatron's unfused CPU attention (within 30%: the plan is an
    estimate), and the parameter count against the megatron model's own."""
    import torch
    from transformers import Qwen2Config

    from benchmarks.memory import allocations
    from megaopd.models.builder import build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.output_layer import defer_output_layer
    from megaopd.parallel.dist import destroy_distributed, init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    hf_dir = tmp_path / "m"
    Qwen2Config(
        hidden_size=512,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=8192,
        max_position_embeddings=1024,
    ).save_pretrained(hf_dir)
    (hf_dir / "config.json").write_text(
        json.dumps({**json.loads((hf_dir / "config.json").read_text()), "architectures": ["Qwen2ForCausalLM"]})
    )
    cfg = read_hf_config(str(hf_dir))
    rows, seq = 4, 512
    role = RoleLayout("student", cfg, 1, 1, "float32")
    torch.set_num_threads(1)
    init_distributed()
    try:
        pgs = initialize_actor_layout(Layout(1, 1), seed=1)
        model = build_gpt_model(cfg, Layout(), pgs).train()
        numel = sum(p.numel() for p in model.parameters())
        ids = torch.randint(0, cfg.vocab_size, (rows, seq))
        pos = torch.arange(seq)[None].expand(rows, seq)
        with torch.no_grad():  # warm-up: allocator pools and lazy buffers (rope cache, masks)
            model(ids[:1, :8], pos[:1, :8], None)
        # Net bytes from torch's allocation events (not RSS growth, which depended on what the allocator
        # kept from earlier tests): the same number alone or after the whole suite.
        logits, events = allocations(lambda: model(ids, pos, None))
        kept = sum(events)
        del logits
        with defer_output_layer(model):
            hidden, events = allocations(lambda: model(ids, pos, None))
        kept_fused = sum(events)
        del hidden
    finally:
        destroy_distributed()
    expected = activation_bytes(role, rows, seq, flash_attention=False) + logits_bytes(role, rows, seq)
    print(f"activations+logits of {rows} x {seq} tokens: measured {kept / 1e6:.0f} MB, plan {expected / 1e6:.0f} MB")
    assert numel == params_per_rank(cfg, 1, 1)  # megatron's own parameter count, vocab padding included
    assert 0.7 * expected < kept < 1.3 * expected
    # The fused output layer: the model stops at the hidden states (its output and megatron's [b, s] copy of
    # it), no logits.
    expected = activation_bytes(role, rows, seq, flash_attention=False) + 2 * hidden_bytes(role, rows * seq)
    print(f"activations+hidden (fused output layer): measured {kept_fused / 1e6:.0f} MB, plan {expected / 1e6:.0f} MB")
    assert 0.7 * expected < kept_fused < 1.3 * expected


def test_plan_vs_measured_finds_the_rank_processes():
    """benchmarks/plan_vs_measured.py measures the rank processes: at world 1 the launcher itself (a single
    rank runs in the `megaopd train` process; the benchmark found no process and failed), otherwise the
    spawned workers, not the resource tracker."""
    import time

    import psutil

    from benchmarks.plan_vs_measured import _rank_processes, _status_kib

    code = (
        "import multiprocessing as mp, time\n"
        "if __name__ == '__main__':\n"
        "    ps = [mp.get_context('spawn').Process(target=time.sleep, args=(5,)) for _ in range(2)]\n"
        "    [p.start() for p in ps]; [p.join() for p in ps]\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    launcher = psutil.Process(proc.pid)
    try:
        assert _rank_processes(launcher, 1) == [launcher] and _status_kib(proc.pid, "VmHWM") > 0
        deadline = time.time() + 20
        while len(_rank_processes(launcher, 2)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        ranks = _rank_processes(launcher, 2)
        assert len(ranks) == 2 and all(p.ppid() == proc.pid for p in ranks)
    finally:
        workers = launcher.children(recursive=True)  # its own workers only
        proc.kill()
        proc.wait()
        for p in workers:
            p.kill()
