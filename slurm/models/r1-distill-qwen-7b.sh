# DeepSeek-R1-Distill-Qwen-7B: a teacher of Stable-OPD (paper 2604.08527), distilled from DeepSeek-R1 into
# Qwen2.5-Math-7B. 28 layers, 28 query heads, 4 KV groups, vocab 152064.
MODEL_HF_ID=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
MODEL_DIRNAME=DeepSeek-R1-Distill-Qwen-7B
# Forward-only scorer: TP=2 as for the other 7B teacher (see openthinker3-7b.sh).
MODEL_TP=2
MODEL_PP=1
MODEL_ENGINE_TP=1
MODEL_MAX_NEW_TOKENS=3072
