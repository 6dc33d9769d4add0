# Qwen2.5-Math-7B: the 7B student of Stable-OPD (paper 2604.08527).
# 28 layers, 28 query heads, 4 KV groups, vocab 152064, context 4096 tokens (max_position_embeddings).
MODEL_HF_ID=Qwen/Qwen2.5-Math-7B
MODEL_DIRNAME=Qwen2.5-Math-7B
# TP must divide the 4 KV groups. TP=2 halves the student's and the reference's weights, gradients and
# Adam states per GPU, which leaves room for the teacher and the colocated engine on one H200.
MODEL_TP=2
MODEL_PP=1
# A 7B model in bf16 (15 GB) fits one GPU with a large KV cache: one engine per GPU gives the most
# rollout throughput.
MODEL_ENGINE_TP=1
# The 4096-token context holds a prompt (up to data.max_prompt_len=1024) plus 3072 generated tokens.
MODEL_MAX_NEW_TOKENS=3072
