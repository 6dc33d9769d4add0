# Qwen3-32B: the teacher of the Qwen3 pairing. From its config.json (huggingface.co/Qwen/Qwen3-32B): 64 layers,
# 64 query heads, 8 KV groups, head_dim 128, hidden 5120, FFN 25600, vocab 151936 (the Qwen3-8B-Base
# student's tokenizer), max_position_embeddings 40960.
MODEL_HF_ID=Qwen/Qwen3-32B
MODEL_DIRNAME=Qwen3-32B
# Forward-only scorer (no gradients, no Adam): TP=4 (divides the 8 KV groups) puts 16.4 GB of bf16 weights
# on each GPU, offloaded between uses; `megaopd plan`: score phase 68.0 GB per GPU beside the 8B student.
MODEL_TP=4
MODEL_PP=1
MODEL_ENGINE_TP=2
MODEL_MAX_NEW_TOKENS=8192
