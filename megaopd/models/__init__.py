"""megaopd.models: HF Qwen2 / Qwen2.5 / Llama configs -> megatron-core GPTModel, the one HF <-> Megatron
weight mapping, Megatron checkpoints. Running the models (forward passes, per-token scores) is
megaopd.scoring's job.

Modules (one job each; importing this package imports neither torch nor megatron):
    hf_config   read_hf_config(dir) -> HFModelConfig; check_layout(cfg, tp, pp); padded_vocab_size(V, tp)
    builder     transformer_config(cfg, tp, pp, dtype); build_gpt_model(cfg, Layout, pg_collection, BuildOptions)
    compat      everything specific to the megatron-core version / TE / apex (layer specs, schedule call)
    weights     the HF <-> Megatron mapping; shard_hf_weights / load_hf_weights (HF -> the rank at a Placement);
                LoRA adapters in the same mapping (adapter_rules: peft names; with_adapter: the merged weight)
    lora        LoRA adapters on megatron's parallel linears: apply_lora, adapters_off, adapter_parameters
    config      ModelConfig / StudentConfig (student.lora: LoRAConfig) and the start-up layout checks
    gather      gather_hf_weights: this rank's shards -> full HF-named tensors (TP/EP all-gather, PP
                collection; collective), for the weight sync, HF export and megatron_to_hf (a LoRA model's
                weights come merged); gather_adapter_weights: its adapters alone, in peft's names
    hf_io       lazy safetensors reading (HFWeights), save_hf_dir (safetensors + config + tokenizer),
                save_peft_adapter (adapter_config.json + adapter_model.safetensors)
    checkpoint  save_model_checkpoint / load_model_checkpoint (dist_checkpointing, any TP/PP on load)
    vocab_padding  mask_vocab_padding: megatron's padded vocabulary columns out of every softmax
    convert     hf_to_megatron / megatron_to_hf (behind tools/convert_*.py)
    presets     random tiny HF models (tests, benchmarks, CPU demo)
    ranks       run a function on tp*pp ranks: torchrun's, or spawned gloo workers

Tests: pytest tests/models -x  (the multi-process ones are marked slow).
"""
