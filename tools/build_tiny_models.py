"""Build the tiny CPU teacher and student (examples/tiny/models/) from nothing, with megaopd's own SFT.

    python tools/build_tiny_models.py            # writes examples/tiny/models/{teacher,student}/ + manifest.json
    python tools/build_tiny_models.py --check    # proves the committed files are what this script makes (below)

What it does (every step seeded; SPECS below holds every size and hyper-parameter):
  1. random initializations: a Qwen2 TEACHER (hidden 128, 4 layers, 0.85M parameters) and a smaller Qwen2
     STUDENT (hidden 96, 3 layers, 0.35M), transformers' own init under torch.manual_seed, saved as HF
     directories with the tiny tokenizer (examples/tiny/tokenizer) and a generation_config (eos 2, pad 0);
  2. the teacher: `megaopd train examples/tiny/sft.yaml` (loss sft on the golden solutions of
     examples/tiny/data/sft.jsonl; SFT-only steps generate nothing), one process, in two stages (each a run
     that starts from the previous run's exported HF dir): 1200 steps at lr 2e-3 then 1500 at lr 1e-3, both
     cosine, 32 solutions per step;
  3. the student: the same SFT, a shorter cold start in two stages (400 then 1600 steps, constant lr 2e-3),
     so that it solves the validation set clearly worse than the teacher but is still on the steep part of
     its learning curve (val accuracy 0.03 -> 0.12 -> 0.20 -> 0.285 on all 200 problems after 0, 800,
     1200, 1600 steps of stage 2), where 40 OPD steps move it; the first stage alone (0.06) left a student
     whose errors were arithmetic facts that 40 OPD steps do not teach (examples/tiny/README.md);
  4. the final HF export of each (RUN/hf: safetensors + config.json + tokenizer + generation_config, the
     export path of any megaopd run) is copied to examples/tiny/models/{teacher,student}; both are evaluated
     with the embedded engine + megaopd.eval on the first EVAL_PROBLEMS problems of
     examples/tiny/data/val.jsonl (temperature 0.6, seeded per problem);
  5. manifest.json records the specs, the versions of torch/transformers/megatron-core, the sha256 of the
     random initializations and of every committed file, each stage's SFT loss curve (sft/nll per step),
     the accuracies, and the build time.

Measured (manifest.json): teacher 0.58, student 0.36 val accuracy (first 64 problems; re-evaluated on 2026-11-26
with the embedded engine's current sampler; 0.61 and 0.33 at the build, with its earlier random draws). Run time on this
shared 2-core CPU: about 39 minutes (teacher 17 + 10 min under a load of 2-13 from other jobs, student
12 min on a nearly idle machine; an SFT step takes 0.15-0.25 s on an idle core, 1-5 s under load).
Committed size: 4.8 MB (fp32 safetensors: teacher 3.4 MB, student 1.4 MB).
`--roles student` rebuilds one model and keeps the other's manifest record.

The teacher with another tokenizer (issue 46, cross-tokenizer distillation), built and checked on its own:

    python tools/build_tiny_models.py --xtok-tokenizer   # examples/tiny/tokenizer_xtok/ (seconds)
    python tools/build_tiny_models.py --xtok             # examples/tiny/models/teacher_xtok/ + xtok_manifest.json
    python tools/build_tiny_models.py --xtok --check     # tokenizer rebuilt byte-identical, files, accuracy

  teacher_xtok = the tiny teacher on another tokenizer, examples/tiny/tokenizer_xtok: the same BPE trainer on
  the same corpus but 384 ids, spaces only leading a token (" to", " both"; the tiny tokenizer has "d ",
  " to ") and its regular ids reversed, so the same text gets other tokens and other ids (64 goldens: 2962
  tiny tokens, 3407 teacher_xtok tokens, 2206 aligned spans); special tokens, their ids 0-3 and the chat
  template are the tiny tokenizer's. Built by transplanting (XTOK_SPEC init "transplant"): the committed
  teacher's transformer body, new embedding / output rows made from the old ones (transplant_init), then
  three SFT stages (XTOK_TRANSPLANT_STAGES: 300 + 300 steps at lr 1e-3, 600 at lr 5e-4). The recipe from
  scratch (init "random": the teacher's own two stages, 2700 steps from a random init) was started but not
  finished: on the shared 2-core machine of 2026-11-28 (load 15-47) an SFT step took 4-11 s instead of 0.2.
  --resume reuses the init and the stages already finished in --work. Accuracy, SFT curves and file hashes:
  examples/tiny/models/xtok_manifest.json; the main manifest and --check do not read it. Measured
  (2026-11-28): val accuracy 0.22 after stage 1, 0.36 after stage 2, 0.53 after stage 3 (the committed files:
  34 of the first 64 problems, against the same-vocabulary teacher's 37, 0.58). Stage 3 ran with
  `--xtok --resume --work DIR` in stages 1-2's work folder (0.37-0.46 s a step), so the manifest's
  build_seconds (272) covers stage 3 and the evaluation only; its sft_nll of stages 1-2 is read back from
  that folder's runs.

--check (2-5 minutes, depending on the machine's load) proves, without retraining:
  a. the committed files are the ones the manifest describes (sha256 of every file of both model dirs);
  b. this script, with the same seeds and library versions, rebuilds bit-identical random initializations
     (their sha256 equals the manifest's);
  c. megaopd's SFT from those initializations, rerun for the first CHECK_STEPS steps of each model's first
     stage with the build's settings, reproduces the manifest's check_nll (|delta nll| <= CHECK_TOL per
     step: the data order, the init and the optimizer are the build's);
  d. the committed weights load in transformers with the manifest's sizes, and re-evaluating them on the
     manifest's validation subset gives the manifest's accuracies (within 2 problems), teacher > student.
It does NOT prove that the full-length SFT (all 2700 teacher steps, all 2000 student steps) reproduces the
committed weights bit for bit, nor anything about the teacher's second stage beyond (a) and (d): that needs
the full build (`python tools/build_tiny_models.py --out /tmp/m` and compare the manifests' file hashes;
the runs are deterministic on one machine with one thread, but float reductions may differ across CPUs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
DATA = os.path.join(ROOT, "examples", "tiny", "data")
DEFAULT_OUT = os.path.join(ROOT, "examples", "tiny", "models")
SFT_PRESET = os.path.join(ROOT, "examples", "tiny", "sft.yaml")

# Qwen2 shapes: heads and KV groups divisible by 2 (student TP=2), vocab = the tiny tokenizer's 256 ids.
# SFT "stages": consecutive `megaopd train` runs, each starting from the previous one's exported HF dir
# (a fresh optimizer and schedule each; lr warms up over warmup_steps, then decays over the stage's steps).
SPECS: dict[str, dict] = {
    "teacher": {
        "hidden": 128,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 384,
        "init_seed": 1,
        "stages": [
            {
                "steps": 1200,
                "prompts_per_step": 32,
                "lr": 2e-3,
                "min_lr": 1e-4,
                "warmup_steps": 30,
                "decay": "cosine",
                "train_seed": 11,
            },
            {
                "steps": 1500,
                "prompts_per_step": 32,
                "lr": 1e-3,
                "min_lr": 5e-5,
                "warmup_steps": 30,
                "decay": "cosine",
                "train_seed": 13,
            },
        ],
    },
    "student": {
        "hidden": 96,
        "layers": 3,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 256,
        "init_seed": 2,
        "stages": [
            {
                "steps": 400,
                "prompts_per_step": 32,
                "lr": 2e-3,
                "min_lr": 1e-4,
                "warmup_steps": 30,
                "decay": "constant",
                "train_seed": 12,
            },
            {
                "steps": 1600,
                "prompts_per_step": 32,
                "lr": 2e-3,
                "min_lr": 1e-4,
                "warmup_steps": 30,
                "decay": "constant",
                "train_seed": 14,
            },
        ],
    },
}
EVAL_PROBLEMS = 64
"""Validation problems (the first N of val.jsonl) the manifest's accuracies are measured on."""
EVAL = {"temperature": 0.6, "max_new_tokens": 128, "seed": 0}
CHECK_STEPS = 12
CHECK_TOL = 2e-3
THREADS = "1"
"""Intra-op threads of the single SFT worker (MEGAOPD_WORKER_THREADS); part of the reproducible setup."""


def log(msg: str) -> None:
    print(f"[build_tiny_models {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dir_hashes(d: str) -> dict[str, str]:
    return {f: sha256(os.path.join(d, f)) for f in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, f))}


def hf_config(spec: dict) -> dict:
    return {
        "vocab_size": spec.get("vocab", 256),
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["ffn"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
    }


def build_init(spec: dict, out_dir: str, tokenizer: str = TOKENIZER) -> int:
    """A randomly initialized Qwen2 (transformers' init, seeded) + a tokenizer folder's files (default: the tiny
    tokenizer); returns #parameters."""
    import torch
    import transformers

    config = transformers.Qwen2Config(**hf_config(spec))
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(spec["init_seed"])
    model = transformers.Qwen2ForCausalLM(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)  # model.safetensors, config.json, generation_config.json (eos 2, pad 0)
    for f in sorted(os.listdir(tokenizer)):
        shutil.copy(os.path.join(tokenizer, f), out_dir)
    return sum(p.numel() for p in model.parameters())


def sft(stage: dict, init_dir: str, run_dir: str, steps: int, extra: tuple = ()) -> list[float]:
    """megaopd's own SFT (examples/tiny/sft.yaml, one process) of one stage from init_dir, for `steps` steps
    of the stage's schedule; returns sft/nll per step. The exported model is run_dir/hf. extra: more
    key=value overrides (tools/build_tiny_agentic.py: its data)."""
    args = [
        sys.executable,
        "-m",
        "megaopd.cli",
        "train",
        SFT_PRESET,
        f"run.dir={run_dir}",
        f"student.path={init_dir}",
        "student.tp=1",
        "reference.tp=1",
        "run.world_size=1",
        f"trainer.max_steps={steps}",
        f"trainer.prompts_per_step={stage['prompts_per_step']}",
        f"trainer.micro_batch_size={stage['prompts_per_step']}",
        f"trainer.seed={stage['train_seed']}",
        f"trainer.save_interval={steps}",
        "trainer.eval_interval=0",
        f"optimizer.lr={stage['lr']}",
        f"optimizer.min_lr={stage['min_lr']}",
        f"optimizer.warmup_steps={stage['warmup_steps']}",
        f"optimizer.decay_style={stage['decay']}",
        f"validation.max_problems={EVAL_PROBLEMS}",
        f"validation.max_new_tokens={EVAL['max_new_tokens']}",
        "logging.progress_bar=off",
        "logging.tensorboard=false",
        *extra,
    ]
    env = dict(os.environ, MEGAOPD_WORKER_THREADS=THREADS, PYTHONPATH=ROOT)
    t0 = time.time()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        words = line.split()
        if (
            len(words) > 2
            and words[0] == "step"
            and words[1].isdigit()
            and words[2].startswith("loss=")
            and (int(words[1]) % 100 == 0 or " val_acc" in line)
        ):
            log(f"  {os.path.basename(run_dir)}: {line.strip()} ({time.time() - t0:.0f}s)")
    if proc.wait() != 0:
        raise SystemExit(f"SFT run {run_dir} failed:\n{''.join(tail)}")
    return sft_curve(run_dir)


def sft_curve(run_dir: str) -> list[float]:
    """sft/nll per step of a finished SFT run."""
    curve = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "sft/nll" in rec:
                curve[rec["step"]] = rec["sft/nll"]
    return [round(curve[s], 6) for s in sorted(curve)]


def evaluate_dir(hf_dir: str, problems: int = EVAL_PROBLEMS) -> dict:
    """Accuracy (and truncation) on the first `problems` of val.jsonl: embedded engine + megaopd.eval."""
    import torch

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.eval.evaluate import EvalConfig, EvalModel, evaluate
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(int(THREADS))
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, device="cpu"))
    tokenizer = load_tokenizer(hf_dir)  # the trainer's loader (AutoTokenizer picks a wrong class here)
    result = evaluate(
        EvalModel(engine, tokenizer),
        [os.path.join(DATA, "val.jsonl")],
        EvalConfig(
            samples=1,
            temperature=EVAL["temperature"],
            max_new_tokens=EVAL["max_new_tokens"],
            limit=problems,
            seed=EVAL["seed"],
        ),
    )
    m = result.to_metrics("val")
    return {
        "accuracy": round(m["val/accuracy"], 4),
        "truncation_rate": round(m["val/truncation_rate"], 4),
        "problems": problems,
    }


def model_sizes(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    return {k: c[k] for k in keys}


def versions() -> dict:
    import megatron.core
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "megatron-core": megatron.core.__version__,
        "python": sys.version.split()[0],
    }


def build(out: str, work: str, roles: list[str]) -> dict:
    t_start = time.time()
    path = os.path.join(out, "manifest.json")
    old = {}
    if set(roles) != set(SPECS) and os.path.isfile(path):  # rebuild some roles, keep the others' records
        with open(path) as f:
            old = json.load(f).get("models", {})
    manifest = {
        "specs": SPECS,
        "eval": {**EVAL, "problems": EVAL_PROBLEMS, "file": "examples/tiny/data/val.jsonl"},
        "check": {"steps": CHECK_STEPS, "tol": CHECK_TOL},
        "threads": THREADS,
        "versions": versions(),
        "models": {r: old[r] for r in SPECS if r not in roles and r in old},
    }
    for role in roles:
        spec = SPECS[role]
        t0 = time.time()
        init = os.path.join(work, f"{role}_init")
        n = build_init(spec, init)
        log(f"{role}: random init ({n / 1e6:.2f}M parameters, seed {spec['init_seed']}) -> {init}")
        curves, src = [], init
        for i, stage in enumerate(spec["stages"]):
            log(
                f"{role}: megaopd SFT stage {i + 1}/{len(spec['stages'])}, {stage['steps']} steps x "
                f"{stage['prompts_per_step']} golden solutions, lr {stage['lr']} ({stage['decay']})"
            )
            run = os.path.join(work, f"{role}_sft{i + 1}")
            curves.append(sft(stage, src, run, stage["steps"]))
            src = os.path.join(run, "hf")
        dst = os.path.join(out, role)
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        acc = evaluate_dir(dst)
        log(
            f"{role}: val accuracy {acc['accuracy']:.3f} on the first {EVAL_PROBLEMS} problems "
            f"(truncation {acc['truncation_rate']:.3f}); {time.time() - t0:.0f}s"
        )
        manifest["models"][role] = {
            "parameters": n,
            "sizes": model_sizes(dst),
            "init_sha256": sha256(os.path.join(init, "model.safetensors")),
            "sft_nll": curves,
            "check_nll": curves[0][:CHECK_STEPS],
            "val": acc,
            "files": dir_hashes(dst),
            "build_seconds": round(time.time() - t0),
        }
    manifest["models"] = {r: manifest["models"][r] for r in SPECS if r in manifest["models"]}
    manifest["build_seconds"] = sum(m["build_seconds"] for m in manifest["models"].values())
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    accs = ", ".join(f"{r} {m['val']['accuracy']:.3f}" for r, m in manifest["models"].items())
    log(f"done in {time.time() - t_start:.0f}s: val accuracy {accs} -> {out}")
    return manifest


def check(out: str, work: str) -> list[str]:
    """Returns the problems found (empty: the check passed); see the module docstring for what it proves."""
    problems = []
    path = os.path.join(out, "manifest.json")
    if not os.path.isfile(path):
        return [f"{path} is missing: run `python tools/build_tiny_models.py`"]
    with open(path) as f:
        manifest = json.load(f)
    if manifest["specs"] != SPECS:
        problems.append("SPECS in this script differ from the manifest's: rebuild the models")
    now = versions()
    for k in ("torch", "transformers", "megatron-core"):
        if manifest["versions"].get(k) != now[k]:
            log(
                f"note: built with {k} {manifest['versions'].get(k)}, checking with {now[k]} "
                f"(random inits and loss curves may differ)"
            )
    for role in ("teacher", "student"):
        spec, rec, d = SPECS[role], manifest["models"][role], os.path.join(out, role)
        # a. committed files
        have = dir_hashes(d) if os.path.isdir(d) else {}
        if have != rec["files"]:
            bad = sorted(set(have) ^ set(rec["files"]) | {f for f in have if rec["files"].get(f) != have[f]})
            problems.append(f"{role}: committed files differ from the manifest: {bad}")
        # b. random initialization
        init = os.path.join(work, f"{role}_init")
        build_init(spec, init)
        if sha256(os.path.join(init, "model.safetensors")) != rec["init_sha256"]:
            problems.append(
                f"{role}: the rebuilt random initialization differs from the manifest's (seed {spec['init_seed']})"
            )
        else:
            log(f"{role}: random initialization rebuilt bit-identical")
        # c. SFT prefix (of the first stage: later stages start from weights only the full build makes)
        curve = sft(spec["stages"][0], init, os.path.join(work, f"{role}_sft1"), CHECK_STEPS)
        ref = rec["check_nll"]  # this code's first steps (may differ from sft_nll's older build: see the manifest)
        worst = max(abs(a - b) for a, b in zip(curve, ref))
        if len(curve) != len(ref) or worst > CHECK_TOL:
            problems.append(
                f"{role}: SFT loss curve of the first {CHECK_STEPS} steps {curve} differs from the "
                f"manifest's {ref} (max |delta| {worst:.2e} > {CHECK_TOL})"
            )
        else:
            log(f"{role}: first {CHECK_STEPS} SFT losses match the manifest (max |delta| {worst:.1e})")
        # d. the committed weights: sizes and accuracy
        if os.path.isdir(d):
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(d)
            n = sum(p.numel() for p in model.parameters())
            if n != rec["parameters"] or model_sizes(d) != rec["sizes"]:
                problems.append(
                    f"{role}: {n} parameters / sizes {model_sizes(d)}; manifest: {rec['parameters']} / {rec['sizes']}"
                )
            acc = evaluate_dir(d)
            # Counted in problems: both accuracies are rounded to 4 decimals, so comparing the fractions against
            # 2 / 64 = 0.03125 refused a difference of exactly 2 problems (0.0313).
            solved, recorded = (round(a * EVAL_PROBLEMS) for a in (acc["accuracy"], rec["val"]["accuracy"]))
            if abs(solved - recorded) > 2:
                problems.append(
                    f"{role}: val accuracy {acc['accuracy']} differs from the manifest's {rec['val']['accuracy']}"
                )
            else:
                log(f"{role}: val accuracy {acc['accuracy']:.3f} (manifest {rec['val']['accuracy']:.3f})")
    t, s = (manifest["models"][r]["val"]["accuracy"] for r in ("teacher", "student"))
    if not t > s:
        problems.append(f"teacher accuracy {t} is not above the student's {s}")
    return problems


# ---- the teacher with another tokenizer (issue 46: cross-tokenizer distillation) ---------------------------------
XTOK_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer_xtok")
XTOK_DIR = "teacher_xtok"
XTOK_MANIFEST = "xtok_manifest.json"
XTOK_VOCAB = 384
"""Ids of the other tokenizer: 380 BPE pieces + 4 special + 2 added, against the tiny tokenizer's 256."""
XTOK_SPEC: dict = {**SPECS["teacher"], "vocab": XTOK_VOCAB, "init": "transplant", "init_seed": 3}
"""The same-vocabulary teacher's sizes on the other vocabulary. init "transplant" (the committed build): the
trained teacher's transformer body with embedding / output rows for the new vocabulary made from the old ones
(transplant_init), then XTOK_TRANSPLANT_STAGES. init "random": its own random init (init_seed) and the
teacher's own two stages (2700 steps, the same train seeds: the same data order); about 30 minutes on an idle
core, but an SFT step took 4-11 s instead of 0.2 on the shared machine of 2026-11-28 (load 15-47), so it was
not run to the end there."""
XTOK_TRANSPLANT_STAGES = [
    {
        "steps": 300,
        "prompts_per_step": 32,
        "lr": 1e-3,
        "min_lr": 5e-5,
        "warmup_steps": 30,
        "decay": "cosine",
        "train_seed": 13,
    },
    {
        "steps": 300,
        "prompts_per_step": 32,
        "lr": 1e-3,
        "min_lr": 5e-5,
        "warmup_steps": 30,
        "decay": "cosine",
        "train_seed": 15,
    },
    {
        "steps": 600,
        "prompts_per_step": 32,
        "lr": 5e-4,
        "min_lr": 2.5e-5,
        "warmup_steps": 30,
        "decay": "cosine",
        "train_seed": 17,
    },
]
"""Stage 1 alone (300 steps) reached val accuracy 0.22, stages 1-2 0.36, all three 0.53 (2026-11-28; the tiny
teacher: 0.58); each stage continues from the previous stage's export. Stage 3's lower lr took the SFT loss
from about 0.045 to 0.018 (the mean of each stage's last 50 steps)."""


def build_xtok_tokenizer(out_dir: str):
    """The other tokenizer: megaopd.data.synthetic's BPE trained on the same corpus (every split, as
    tools/build_tiny_data.py) at XTOK_VOCAB ids and with spaces only leading a token (spaces_lead), so its
    pieces cross the tiny tokenizer's ("d " + "to " there, " to" here) instead of merely coarsening them (a
    larger BPE of the same corpus and pre-tokenizer holds the smaller one's merges); then its regular ids are
    reversed (4..379 -> 379..4) so that even the single characters both share get other ids (a code path that
    forgot to re-tokenize would read nonsense, not almost-right text). Special and added tokens keep the tiny
    tokenizer's names and ids 0-3 (<|endoftext|> pad, <|im_start|>, <|im_end|> eos, <|unk|>) and its chat
    template: the texts map, the tokens do not."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megaopd.data.synthetic import build_tokenizer, save_tokenizer, tokenizer_corpus

    rows = []
    for split in ("sft", "opd", "val"):
        with open(os.path.join(DATA, f"{split}.jsonl")) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    tok = build_tokenizer(tokenizer_corpus(rows), vocab_size=XTOK_VOCAB, spaces_lead=True)
    spec = json.loads(tok.backend_tokenizer.to_str())
    added = {t["id"] for t in spec["added_tokens"]}
    regular = sorted(i for i in spec["model"]["vocab"].values() if i not in added)
    flip = dict(zip(regular, reversed(regular)))
    spec["model"]["vocab"] = {t: flip.get(i, i) for t, i in spec["model"]["vocab"].items()}
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        chat_template=tok.chat_template,
        model_max_length=tok.model_max_length,
    )
    save_tokenizer(other, out_dir)
    return other


def transplant_init(src_dir: str, out_dir: str) -> int:
    """The trained teacher (src_dir) on the other tokenizer (tools/transplant_vocab.py: every weight but the
    vocabulary's copied; a new token's embedding the mean of its text's old embeddings, its output row its
    text's first old token's). Returns #parameters."""
    from transplant_vocab import transplant

    return transplant(src_dir, XTOK_TOKENIZER, out_dir)


def build_xtok(out: str, work: str, resume: bool = False) -> dict:
    """examples/tiny/models/teacher_xtok and xtok_manifest.json: the teacher on the other tokenizer."""
    t0 = time.time()
    init = os.path.join(work, "xtok_init")
    if resume and os.path.isfile(os.path.join(init, "model.safetensors")):
        import transformers

        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(init).parameters())
        log(f"teacher_xtok: resuming in {work} (init and finished stages reused)")
    elif XTOK_SPEC["init"] == "transplant":
        n = transplant_init(os.path.join(out, "teacher"), init)
        log(f"teacher_xtok: the tiny teacher transplanted to vocabulary {XTOK_VOCAB} ({n / 1e6:.2f}M parameters)")
    else:
        n = build_init(XTOK_SPEC, init, XTOK_TOKENIZER)
        log(f"teacher_xtok: random init ({n / 1e6:.2f}M parameters, vocabulary {XTOK_VOCAB}) -> {init}")
    curves, src = [], init
    stages = XTOK_TRANSPLANT_STAGES if XTOK_SPEC["init"] == "transplant" else XTOK_SPEC["stages"]
    for i, stage in enumerate(stages):
        log(f"teacher_xtok: megaopd SFT stage {i + 1}/{len(stages)}, {stage['steps']} steps")
        run = os.path.join(work, f"xtok_sft{i + 1}")
        done = resume and os.path.isfile(os.path.join(run, "hf", "model.safetensors"))
        curves.append(sft_curve(run) if done else sft(stage, src, run, stage["steps"]))
        src = os.path.join(run, "hf")
    dst = os.path.join(out, XTOK_DIR)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    acc = evaluate_dir(dst)
    log(f"teacher_xtok: val accuracy {acc['accuracy']:.3f} on the first {EVAL_PROBLEMS} problems")
    manifest = {
        "spec": XTOK_SPEC,
        "stages_run": stages,
        "eval": {**EVAL, "problems": EVAL_PROBLEMS, "file": "examples/tiny/data/val.jsonl"},
        "threads": THREADS,
        "versions": versions(),
        "parameters": n,
        "sizes": model_sizes(dst),
        "init_sha256": sha256(os.path.join(work, "xtok_init", "model.safetensors")),
        "tokenizer": dir_hashes(XTOK_TOKENIZER),
        "sft_nll": curves,
        "val": acc,
        "files": dir_hashes(dst),
        "build_seconds": round(time.time() - t0),
    }
    with open(os.path.join(out, XTOK_MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def check_xtok(out: str, work: str) -> list[str]:
    """The other tokenizer rebuilds byte-identical, the committed teacher_xtok files are the manifest's, and its
    accuracy re-evaluates within 2 problems of the manifest's."""
    problems = []
    fresh = os.path.join(work, "tokenizer_xtok")
    build_xtok_tokenizer(fresh)
    if dir_hashes(fresh) != dir_hashes(XTOK_TOKENIZER):
        problems.append(f"{XTOK_TOKENIZER} differs from a fresh build_xtok_tokenizer")
    path = os.path.join(out, XTOK_MANIFEST)
    if not os.path.isfile(path):
        return problems + [f"{path} is missing: run `python tools/build_tiny_models.py --xtok`"]
    with open(path) as f:
        rec = json.load(f)
    d = os.path.join(out, XTOK_DIR)
    if (dir_hashes(d) if os.path.isdir(d) else {}) != rec["files"]:
        problems.append(f"{d}: committed files differ from {XTOK_MANIFEST}")
    else:
        acc = evaluate_dir(d)
        solved, recorded = (round(a * EVAL_PROBLEMS) for a in (acc["accuracy"], rec["val"]["accuracy"]))
        if abs(solved - recorded) > 2:
            problems.append(f"teacher_xtok: val accuracy {acc['accuracy']} differs from the manifest's")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="where teacher/, student/ and manifest.json go")
    ap.add_argument("--work", default=None, help="scratch folder for the inits and SFT runs (default: a temp dir)")
    ap.add_argument("--check", action="store_true", help="verify the files in --out instead of building")
    ap.add_argument("--roles", default="teacher,student", help="build only these (the manifest keeps the others)")
    ap.add_argument(
        "--xtok",
        action="store_true",
        help="the teacher with another tokenizer (teacher_xtok, xtok_manifest.json) instead; with --check, check it",
    )
    ap.add_argument("--xtok-tokenizer", action="store_true", help="only rebuild examples/tiny/tokenizer_xtok")
    ap.add_argument(
        "--resume", action="store_true", help="--xtok: reuse the init and the finished stages found in --work"
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tiny_models_") as tmp:
        work = args.work or tmp
        if os.path.isdir(work) and os.listdir(work) and args.work and not args.resume:
            raise SystemExit(f"--work {work} is not empty: SFT runs resume from checkpoints there; use a fresh one")
        os.makedirs(work, exist_ok=True)
        if args.xtok_tokenizer:
            build_xtok_tokenizer(XTOK_TOKENIZER)
            return 0
        if args.xtok and not args.check:
            os.makedirs(args.out, exist_ok=True)
            build_xtok(args.out, work, resume=args.resume)
            return 0
        if not args.check:
            os.makedirs(args.out, exist_ok=True)
            build(args.out, work, [r for r in SPECS if r in args.roles.split(",")])
            return 0
        problems = check_xtok(args.out, work) if args.xtok else check(args.out, work)
    if problems:
        print("tiny models check FAILED:\n  " + "\n  ".join(problems), flush=True)
        return 1
    print(f"tiny models check passed ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
