"""RoPE context extension of a model's folders: the same rope_theta and max_position_embeddings written into
the config.json of every folder the job loads the student from (the HF directory the engines serve, the
megaopd checkpoint the trainer loads, which keeps its config at hf/config.json), never a silent edit.

Qwen2.5-Math-1.5B/7B ship 4096 positions at rope_theta 10000; the paper's 1024-token prompts plus 8192-token
responses need 9216. Recipes built on OpenR1-Math raise both (sources, read 2026-11):
- luffy: Yan et al. 2025 ("LUFFY", the paper's data recipe) train Qwen2.5-Math-7B from
  Elliott/Qwen2.5-Math-7B-16k-think (github.com/ElliottYan/LUFFY README.md and exp_scripts/train.sh:
  MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think), whose change is "rope_theta from 10000 to 40000 and the
  context window to 16k" (as restated by huggingface.co/yangzhch6/Qwen2.5-Math-7B-L, "Following LUFFY").
- open-r1: Open-R1 trains OpenR1-Distill-7B from open-r1/Qwen2.5-Math-7B-RoPE-300k at 32768 tokens
  (github.com/huggingface/open-r1 recipes/OpenR1-Distill-7B/sft/config_distill.yaml: model_name_or_path,
  max_length 32768; README.md "Training models"): RoPE base 300000, 32768 positions.

    python tools/extend_context.py --recipe luffy $MODELS_DIR/Qwen2.5-Math-7B $CKPT/student
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextRecipe:
    rope_theta: float
    max_position_embeddings: int
    source: str


RECIPES = {
    "luffy": ContextRecipe(40000.0, 16384, "LUFFY (Yan et al. 2025): Elliott/Qwen2.5-Math-7B-16k-think"),
    "open-r1": ContextRecipe(300000.0, 32768, "Open-R1: open-r1/Qwen2.5-Math-7B-RoPE-300k"),
}


def model_config_files(folder: str) -> list[str]:
    """The config.json files of an HF directory and/or a megaopd checkpoint folder (hf/config.json)."""
    found = [
        p for p in (os.path.join(folder, "config.json"), os.path.join(folder, "hf", "config.json")) if os.path.isfile(p)
    ]
    if not found:
        raise FileNotFoundError(
            f"no config.json in {folder!r} (nor in {folder}/hf): pass an HF model directory "
            f"or a checkpoint written by tools/convert_hf_to_megatron.py"
        )
    return found


def extend_context(path: str, rope_theta: float, max_position_embeddings: int) -> tuple[dict, dict] | None:
    """Writes the two values into one config.json (a copy of the original is kept as config.json.orig the
    first time). Returns (old, new) values, or None when the file already has them. Both RoPE layouts are
    updated: the top-level `rope_theta` of real Qwen2.5 files and transformers 5's `rope_parameters`."""
    with open(path) as f:
        raw = json.load(f)
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    old_theta = raw.get("rope_theta", (params or {}).get("rope_theta"))
    old = {"rope_theta": old_theta, "max_position_embeddings": raw.get("max_position_embeddings")}
    new = {"rope_theta": float(rope_theta), "max_position_embeddings": int(max_position_embeddings)}
    if (
        old_theta is not None
        and float(old_theta) == new["rope_theta"]
        and old["max_position_embeddings"] == new["max_position_embeddings"]
    ):
        return None
    if raw.get("rope_scaling") or (params or {}).get("rope_type", "default") not in ("default", None):
        raise ValueError(
            f"{path} uses RoPE scaling ({raw.get('rope_scaling') or params}): a rope_theta change on "
            f"top of it is not one of the recipes; extend the unscaled base model instead"
        )
    backup = path + ".orig"
    if not os.path.exists(backup):
        shutil.copy2(path, backup)
    if "rope_theta" in raw or params is None:
        raw["rope_theta"] = new["rope_theta"]
    if params is not None:
        params["rope_theta"] = new["rope_theta"]
    raw["max_position_embeddings"] = new["max_position_embeddings"]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return old, new
