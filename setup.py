"""megaopd: on-policy distillation with Megatron-core students/teachers and SGLang rollouts."""

from setuptools import find_packages, setup

setup(
    name="megaopd",
    version="0.1.0",
    description="On-policy distillation (Stable-OPD, LSM, OPD, GKD, GRPO) with Megatron-core and SGLang",
    python_requires=">=3.10",
    packages=find_packages(include=["megaopd", "megaopd.*"]),
    package_data={"megaopd": ["config/presets/*.yaml"]},
    # torch is pinned by the installer (scripts/install.sh) before this runs, so that no
    # dependency resolves to a CUDA build on a CPU machine; any torch>=2.4 works here.
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "transformers>=4.50",
        "datasets",
        "omegaconf>=2.3",
        "safetensors",
        "math-verify[antlr4-13-2]",
        "psutil",  # megatron dist_checkpointing's async writers
        "einops",  # imported by megatron-core modules we load
        "tqdm",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        # apex is built from source on clusters (see README, "GPU clusters"); it has no wheel.
        # SGLang: the weight-update protocol megaopd speaks is that of 0.5.20-0.5.x (sessions around
        # updates, detected from /server_info; see docs/engines.md for the torch / megatron-core /
        # Transformer Engine pairing). 0.6 may change it again: raise the bound after testing.
        "gpu": ["transformer-engine[pytorch]>=2.0", "sglang[all]>=0.5.20,<0.6", "sglang-router"],
        # Weights & Biases logging (logging.wandb): a 20 MB wheel that pulls no torch. 0.31 is the
        # version tested (the tests read runs back with its `wandb leet inspect`).
        "wandb": ["wandb>=0.31"],
        # The real-model tier's model (tools/fetch_smollm2.py, scripts/install_smollm2.sh): transformers'
        # GGUF loader needs both to dequantize SmolLM2-135M-Instruct's GGUF. Pure Python, no torch pulled.
        "real": ["gguf>=0.10", "accelerate>=1.0"],
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.6",
            "wandb>=0.31",
            "gguf>=0.10",
            "accelerate>=1.0",
            "ruff==0.17.6",
            # The LoRA export tests load the exported adapter onto the HF base with peft (its deps are torch,
            # transformers, accelerate, safetensors, huggingface-hub: all already required here).
            "peft==0.21.2",
        ],
    },
    entry_points={"console_scripts": ["megaopd=megaopd.cli:main"]},
)
