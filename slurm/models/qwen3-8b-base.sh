# Qwen3-8B-Base: the student of the Qwen3 pairing (examples/qwen3/stable_opd_qwen3_8b.yaml), the setting of the
# on-policy distillation write-up (Qwen3-8B-Base distilled from Qwen3-32B). From its config.json
# (huggingface.co/Qwen/Qwen3-8B-Base): 36 layers, 32 query heads, 8 KV groups, head_dim 128, hidden 4096,
# FFN 12288, vocab 151936 (untied), max_position_embeddings 32768 (a 1024 + 8192 token row fits unextended).
MODEL_HF_ID=Qwen/Qwen3-8B-Base
MODEL_DIRNAME=Qwen3-8B-Base
# TP must divide the 8 KV groups. `megaopd plan` at TP=2, 8 H200, bf16, distributed Adam, colocated engines
# at 0.5: peak 112.4 GB per GPU (generate), train 104.0 GB (numbers in the preset).
MODEL_TP=2
MODEL_PP=1
# 8.2B in bf16 (16.4 GB) fits one GPU with a large KV cache: one engine per GPU.
MODEL_ENGINE_TP=1
MODEL_MAX_NEW_TOKENS=8192
