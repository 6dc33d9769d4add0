"""megaopd: on-policy distillation of LLMs with Megatron-core models and SGLang rollouts."""

__version__ = "0.1.0"
