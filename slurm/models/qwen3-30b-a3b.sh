# Qwen3-30B-A3B: a mixture-of-experts teacher for the Qwen3-8B-Base student (same tokenizer, vocab 151936).
# From its config.json (huggingface.co/Qwen/Qwen3-30B-A3B): 48 layers, 32 query heads, 4 KV groups, head_dim
# 128, hidden 2048, 128 routed experts of FFN 768 per layer (top 8, renormalized, no shared expert),
# max_position_embeddings 40960; 30.5B parameters, of which 29.0B in the experts.
MODEL_HF_ID=Qwen/Qwen3-30B-A3B
MODEL_DIRNAME=Qwen3-30B-A3B
# Forward-only: TP=1 and expert parallelism over 8 ranks (EP must divide the data-parallel size, 8 on two
# 4-GPU nodes, and the 128 experts): each GPU holds 16 experts per layer and the whole attention, 5.2B
# parameters = 10.3 GB of bf16 weights (hand count: megaopd plan counts a dense FFN and does not know EP yet).
MODEL_TP=1
MODEL_PP=1
MODEL_EP=8
MODEL_ENGINE_TP=2
MODEL_MAX_NEW_TOKENS=8192
