"""Write a student made by removing decoder layers from an HF model (a compressed copy to distill into).

    python tools/prune_layers.py --src HF_DIR --drop 16-19 [--out DIR]
    python tools/prune_layers.py --src ~/.cache/megaopd/models/SmolLM2-135M-Instruct --drop 16-19
        # -> ~/.cache/megaopd/models/SmolLM2-135M-Instruct-drop16-19 (the default out: SRC-dropSPEC beside SRC)

--drop takes layer indices (0-based) and ranges, e.g. `16-19` or `0,5,10-12`. The kept layers keep their
order and are renumbered 0..n-1; embeddings, final norm and head are copied unchanged, so the student shares
the source's tokenizer, chat template and vocabulary (what OPD's teacher-scoring needs). Works on any HF
folder whose layers are `model.layers.N.*` in safetensors (Llama, Qwen2, Qwen3); per-layer config lists
(`layer_types`) are cut to match. The last line printed is the out folder.

On SmolLM2-135M-Instruct, golden-solution NLL on arithmetic word problems (issue 44): the full model 1.07,
layers 16-19 removed 1.80; removing the last 10 layers or every other
layer leaves 12.8-13.2 (a broken model, not a student). Middle layers are the ones to remove.

Idempotent: the folder is written under a temporary name and renamed into place with a marker file
(.megaopd-complete, which records the source and the removed layers); an existing complete folder is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

PROG = "prune_layers"
MARKER = ".megaopd-complete"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


class PruneError(Exception):
    """One line for the user (exit 2)."""


def parse_drop(spec: str) -> list[int]:
    """`16-19` or `0,5,10-12` -> sorted unique indices."""
    out: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise PruneError(f"--drop {spec!r}: use layer indices and ranges, e.g. 16-19 or 0,5,10-12")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise PruneError(f"--drop {spec!r}: the range {lo}-{hi} is empty (write it low-high)")
        out.update(range(lo, hi + 1))
    return sorted(out)


def default_out(src: str, drop: list[int]) -> str:
    return os.path.abspath(src.rstrip("/")) + "-drop" + _spec_name(drop)


def _spec_name(drop: list[int]) -> str:
    """[16,17,18,19] -> '16-19'; [0,5,10,11] -> '0_5_10-11'."""
    runs, start = [], None
    for i, d in enumerate(drop):
        start = d if start is None else start
        if i + 1 == len(drop) or drop[i + 1] != d + 1:
            runs.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return "_".join(runs)


def _read_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise PruneError(
            f"--src {src}: no config.json there (give an HF model folder, e.g. one written by tools/fetch_smollm2.py)"
        )
    with open(path) as f:
        return json.load(f)


def pruned_config(raw: dict, drop: list[int]) -> dict:
    """config.json of the student: fewer layers, per-layer lists cut to the kept layers."""
    n = raw.get("num_hidden_layers")
    if not isinstance(n, int):
        raise PruneError("config.json has no integer num_hidden_layers: not a decoder model this tool knows")
    bad = [d for d in drop if d >= n]
    if bad:
        raise PruneError(f"--drop names layer(s) {bad} but the model has layers 0-{n - 1}")
    if len(drop) >= n:
        raise PruneError(f"--drop removes all {n} layers: keep at least one")
    keep = [i for i in range(n) if i not in set(drop)]
    out = dict(raw, num_hidden_layers=len(keep))
    if isinstance(raw.get("layer_types"), list):
        out["layer_types"] = [raw["layer_types"][i] for i in keep]
    if isinstance(raw.get("max_window_layers"), int):  # Qwen2: layers from this index on use sliding windows
        out["max_window_layers"] = min(raw["max_window_layers"], len(keep))
    return out


def pruned_tensors(tensors: dict, n_layers: int, drop: list[int]) -> dict:
    """The source's tensors minus the dropped layers' ones, the rest renumbered 0..kept-1."""
    new_index = {old: new for new, old in enumerate(i for i in range(n_layers) if i not in set(drop))}
    out = {}
    for name, t in tensors.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = t
        elif int(m.group(1)) in new_index:
            out[f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"] = t
    return out


def _load_tensors(src: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise PruneError(f"--src {src}: no *.safetensors weights there")
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(src, f)))
    return tensors


def prune(src: str, drop: list[int], out: str | None = None) -> str:
    """Writes the pruned copy of src (layers `drop` removed) to out, or reuses a complete one; returns out."""
    out = os.path.abspath(out or default_out(src, drop))
    if os.path.isfile(os.path.join(out, MARKER)):
        return out
    raw = _read_config(src)
    config = pruned_config(raw, drop)
    tensors = pruned_tensors(_load_tensors(src), raw["num_hidden_layers"], drop)
    if not any(_LAYER.match(n) for n in tensors):
        raise PruneError(f"--src {src}: no tensors named model.layers.N.* (its layers are named otherwise)")
    from safetensors.torch import save_file

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(out)}.") as tmp:
        staged = os.path.join(tmp, "hf")
        os.makedirs(staged)
        # Tied embeddings are stored once (safetensors refuses shared storage; HF re-ties lm_head on load).
        save_file(
            {n: t.contiguous() for n, t in tensors.items()},
            os.path.join(staged, "model.safetensors"),
            metadata={"format": "pt"},
        )
        with open(os.path.join(staged, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in _COPIED:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), os.path.join(staged, name))
        with open(os.path.join(staged, MARKER), "w") as f:
            json.dump(
                {
                    "source": os.path.abspath(src),
                    "dropped_layers": drop,
                    "layers": f"{raw['num_hidden_layers']} -> {config['num_hidden_layers']}",
                },
                f,
                indent=1,
            )
        if os.path.lexists(out):  # an incomplete folder of an interrupted older run
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="HF model folder (config.json + *.safetensors)")
    ap.add_argument("--drop", required=True, help="layers to remove, 0-based: e.g. 16-19 or 0,5,10-12")
    ap.add_argument("--out", default=None, help="folder to write (default: SRC-dropSPEC beside SRC)")
    a = ap.parse_args(argv)
    try:
        out = prune(a.src, parse_drop(a.drop), a.out)
    except PruneError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
