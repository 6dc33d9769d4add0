"""HF model directories on disk: lazy safetensors reading, safetensors writing, side files.

    weights = HFWeights(hf_dir)            # reads only the tensors asked for; never unpickles
    weights["model.norm.weight"]
    save_hf_dir(out_dir, tensors, config_json, side_files_from=src_dir)

Only safetensors are read: pytorch_model.bin files are pickles, and loading an untrusted pickle runs
arbitrary code, so a directory that has only those is refused with the fix.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Iterable

import torch

from megaopd.models.hf_config import InputError

# Files copied beside the weights so the output loads with AutoTokenizer / generate().
SIDE_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab.",
    "merges.txt",
    "generation_config",
    "chat_template",
    "preprocessor_config",
)
INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 4 * 1024**3  # one safetensors file per ~4 GiB, like save_pretrained


class HFWeightsError(InputError):
    """The HF directory has no usable weights; the message says which files and the fix."""


def safetensors_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: file} of an HF directory (single file or sharded with an index)."""
    index = os.path.join(hf_dir, INDEX_NAME)
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if any(n.endswith(".bin") or n.endswith(".pt") for n in os.listdir(hf_dir)):
        raise HFWeightsError(
            f"{hf_dir} has only pickle weights (*.bin); megaopd reads safetensors only: "
            "re-save with model.save_pretrained(dir, safe_serialization=True)"
        )
    raise HFWeightsError(f"no model.safetensors or {INDEX_NAME} in {hf_dir}")


class HFWeights(Mapping):
    """Lazy read access to the tensors of an HF directory: w[name] opens its file on demand."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self.files = safetensors_files(hf_dir)
        self._handles: dict[str, object] = {}

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"{name} is not in the safetensors of {self.hf_dir}")
        path = self.files[name]
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]


def copy_side_files(src_dir: str, dst_dir: str, include_config: bool = True) -> list[str]:
    """Copies config.json and tokenizer / generation files; returns the names copied."""
    copied = []
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if not os.path.isfile(path):
            continue
        if (include_config and name == "config.json") or name.startswith(SIDE_FILE_PREFIXES):
            shutil.copyfile(path, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def save_hf_dir(
    out_dir: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config_json: dict | None = None,
    side_files_from: str | None = None,
) -> None:
    """Writes model.safetensors (sharded with an index past SHARD_BYTES) + config.json + side files.

    `tensors` is consumed as a stream: at most one shard is held in memory. Shards are written under
    temporary names and renamed once their count (the "-of-N" in the names) is known.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt"}  # what transformers expects in the safetensors header
    written: list[tuple[str, dict[str, int]]] = []  # (temp file, {name: nbytes})
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        tmp = os.path.join(out_dir, f".shard-{len(written):05d}.safetensors.tmp")
        save_file(shard, tmp, metadata=meta)
        written.append((tmp, {n: t.numel() * t.element_size() for n, t in shard.items()}))
        shard, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t.detach().cpu().contiguous()
        size += nbytes
    if shard or not written:
        flush()
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map, total = {}, 0
        for i, (tmp, sizes) in enumerate(written):
            fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            os.replace(tmp, os.path.join(out_dir, fname))
            for name, nbytes in sizes.items():
                weight_map[name] = fname
                total += nbytes
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if side_files_from is not None:
        copy_side_files(side_files_from, out_dir, include_config=config_json is None)
    if config_json is not None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2, sort_keys=True)


PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}  # fmt: skip
"""The HF projections a megatron linear's adapter becomes (peft's target_modules)."""


def save_peft_adapter(
    out_dir: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    rank: int,
    alpha: float,
    linears: Iterable[str],
    base_model: str = "",
    dropout: float = 0.0,
) -> None:
    """Writes a peft LoRA adapter folder (adapter_config.json, adapter_model.safetensors) that
    peft.PeftModel.from_pretrained(base, out_dir) loads onto the HF base model. tensors: (peft name, tensor),
    e.g. megaopd.models.gather.gather_adapter_weights; linears: the adapted megatron linears (linear_qkv, ...)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weights = {name: t.detach().cpu().contiguous() for name, t in tensors}
    save_file(weights, os.path.join(out_dir, PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(m for linear in linears for m in PEFT_MODULES[linear]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    with open(os.path.join(out_dir, PEFT_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def tokenizer_dir(path: str) -> str:
    """Where a role's tokenizer files are: the HF directory, or the one kept beside a checkpoint."""
    for candidate in (path, os.path.join(path, "hf")):
        if any(os.path.exists(os.path.join(candidate, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return candidate
    raise FileNotFoundError(
        f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path!r}: copy the "
        f"model's tokenizer files there (tools/convert_hf_to_megatron.py does it)"
    )


def load_tokenizer(path: str):
    """The tokenizer of an HF directory or of a megaopd checkpoint (tokenizer_dir). transformers 5's
    AutoTokenizer replaces the class that tokenizer_config.json names with the model type's own (Qwen2Tokenizer
    beside a qwen2 config.json), which rebuilds a byte-level pipeline: for a tokenizer that is not byte-level,
    such as examples/tiny/tokenizer, it silently drops every space and newline. A directory whose
    tokenizer_config.json names the generic fast class is therefore loaded with that class; any other goes
    through AutoTokenizer."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = tokenizer_dir(path)
    config = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            if json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
                return PreTrainedTokenizerFast.from_pretrained(d)
    return AutoTokenizer.from_pretrained(d)
