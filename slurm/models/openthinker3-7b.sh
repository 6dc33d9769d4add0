# OpenThinker3-7B: a teacher of Stable-OPD (paper 2604.08527), fine-tuned from Qwen2.5-7B-Instruct.
# 28 layers, 28 query heads, 4 KV groups, vocab 152064 (the Qwen2.5-Math-7B student's), long context.
MODEL_HF_ID=open-thoughts/OpenThinker3-7B
MODEL_DIRNAME=OpenThinker3-7B
# Forward-only scorer: no gradients or optimizer states. TP=2 keeps its 7.5 GB/GPU of bf16 weights next to
# the student's without pipeline bubbles.
MODEL_TP=2
MODEL_PP=1
MODEL_ENGINE_TP=1
MODEL_MAX_NEW_TOKENS=3072
