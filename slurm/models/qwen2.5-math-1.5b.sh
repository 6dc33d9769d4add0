# Qwen2.5-Math-1.5B: the 1.5B student of Stable-OPD (paper 2604.08527, table 2 ablation).
# 28 layers, 12 query heads, 2 KV groups, vocab 151936, context 4096 tokens.
MODEL_HF_ID=Qwen/Qwen2.5-Math-1.5B
MODEL_DIRNAME=Qwen2.5-Math-1.5B
# 1.5B with Adam states is ~25 GB: no tensor parallelism needed on an H200; pure data parallelism is faster.
MODEL_TP=1
MODEL_PP=1
MODEL_ENGINE_TP=1
# Same 4096-token context as the 7B: a 1024-token prompt plus 3072 generated tokens.
MODEL_MAX_NEW_TOKENS=3072
