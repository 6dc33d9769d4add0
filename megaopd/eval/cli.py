"""`megaopd eval`: benchmark table of a checkpoint.

    megaopd eval --ckpt HF_OR_MEGATRON_DIR --benchmarks math500,minerva,olympiadbench,amc,aime24,aime25 \\
        [--engines URL[,URL...]] [--samples K] [--temperature 0.6] [--max-new-tokens N] [--limit N] [--out DIR]
        [--extract boxed|latex|number|answer_is|any]

--engines: generate on running SGLang servers (or `megaopd serve`) serving the checkpoint, through the
trainer's EnginePool (megaopd.eval.engines); only the tokenizer is read from --ckpt, no model is loaded
here. Without it, the embedded engine below. Scoring, tables and files are the same either way, and a
killed evaluation started again with the same --out generates only what generations.jsonl lacks.

--ckpt: a Hugging Face folder (config.json + weights + tokenizer) runs on the embedded engine
(megaopd.rollout.embedded); a megaopd Megatron checkpoint (megaopd_checkpoint.json) is first exported to
HF with megaopd.models.convert (the library behind tools/convert_megatron_to_hf.py) into a temporary
folder under OUT, removed afterwards. Benchmarks are read from --data-dir/<name>.jsonl (tools/prepare_benchmarks.py
writes them)
or given as paths to .jsonl files. Prints the results table; OUT gets results.md, results.json and
generations.jsonl (default OUT: CKPT/eval).

--extract: where the answer is read from a response (megaopd.metrics.reward): boxed (the last \\boxed{},
the paper's rule, default), latex, number (for models that do not box), answer_is, any. The table says how
many responses had an answer ("answers found: 12 of 50"), with a one-line warning when almost none did.
Run again with the same --out and another --extract, the stored responses are re-scored, not generated.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile

from megaopd.eval.benchmarks import BENCHMARKS, DEFAULT_DATA_DIR, resolve_benchmarks
from megaopd.eval.evaluate import EvalConfig, EvalModel, evaluate
from megaopd.metrics.reward import EXTRACTIONS, RewardConfig
from megaopd.metrics.rollout import RepetitionConfig


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def export_megatron_to_hf(ckpt: str, out_dir: str) -> str:
    """megaopd Megatron checkpoint -> HF folder at out_dir, through the one converter (megaopd.models)."""
    from megaopd.models.convert import megatron_to_hf

    logging.getLogger(__name__).info("exporting Megatron checkpoint %s to HF at %s", ckpt, out_dir)
    megatron_to_hf(ckpt, out_dir)
    return out_dir


def load_engine(hf_dir: str, max_batch_size: int = 64, dtype: str = "float32"):
    """The embedded (in-process HF transformers) engine over hf_dir; GPU when present."""
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(
        EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=max_batch_size, dtype=dtype, load_tokenizer=False)
    )


def parse_samples(spec: str | None) -> tuple[int | None, dict[str, int]]:
    """--samples: "K" -> (K, {}); "amc=32,aime24=16" -> (None, {"amc": 32, "aime24": 16})."""
    if spec is None:
        return None, {}
    try:
        if "=" not in spec:
            return int(spec), {}
        pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
        out = {name.strip(): int(k) for name, k in pairs}
    except ValueError:
        raise ValueError(f"--samples {spec!r}: write K (every benchmark) or NAME=K,NAME=K") from None
    if any(k < 1 for k in out.values()):
        raise ValueError(f"--samples {spec!r}: every count must be at least 1")
    return None, out


def build_parser() -> argparse.ArgumentParser:
    d = EvalConfig()
    ap = argparse.ArgumentParser(
        prog="megaopd eval", description="Benchmark table of a checkpoint (math-verify scoring)."
    )
    ap.add_argument("--ckpt", required=True, help="HF folder or Megatron checkpoint")
    ap.add_argument(
        "--benchmarks",
        default=",".join(BENCHMARKS),
        help=f"comma-separated names ({', '.join(BENCHMARKS)}) or .jsonl paths",
    )
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder of <name>.jsonl benchmark files")
    ap.add_argument(
        "--samples",
        default=None,
        help="samples per problem: K for every benchmark, or NAME=K,... per benchmark (the others "
        "keep their default); default: pass@1 / avg@32 as in the paper",
    )
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--top-p", type=float, default=d.top_p)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument(
        "--engines",
        default=None,
        metavar="URL[,URL...]",
        help="evaluate on these running SGLang / megaopd serve servers instead of the embedded engine",
    )
    ap.add_argument(
        "--engine-timeout",
        type=float,
        default=3600.0,
        help="seconds one /generate request to one server may take (with --engines)",
    )
    ap.add_argument(
        "--engine-wait",
        type=float,
        default=30.0,
        help="seconds to wait for every server's /health before giving up (with --engines)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"sequences per generate call (default {d.batch_size}; with --engines 256 per server)",
    )
    ap.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--dtype", default="float32", help="embedded engine dtype (bfloat16 on GPU)")
    ap.add_argument(
        "--repetition-window",
        type=int,
        default=RepetitionConfig().window_chars,
        help="L of the repetition rate, in characters (paper: 10000)",
    )
    ap.add_argument(
        "--extract",
        choices=list(EXTRACTIONS),
        default=d.reward.extract,
        help="where the answer is read from a response: boxed = the last \\boxed{} (the paper's rule); "
        "latex = the last LaTeX expression; number = the last number (models that do not box); "
        "answer_is = 'the answer is ...'; any = math-verify's default order",
    )
    ap.add_argument("--no-chat-template", action="store_true", help="plain prompt even if the tokenizer has a template")
    ap.add_argument("--label", default=None, help="row name in the table (default: the checkpoint folder's name)")
    ap.add_argument("--out", default=None, help="output folder (default: CKPT/eval)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ckpt = os.path.normpath(args.ckpt)
    if not os.path.isdir(ckpt):
        print(f"megaopd eval: --ckpt {ckpt} is not a folder", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.join(ckpt, "eval")
    urls: list[str] = []
    if args.engines is not None:
        from megaopd.eval.engines import parse_urls

        try:
            urls = parse_urls(args.engines)
        except ValueError as e:
            print(f"megaopd eval: {e}", file=sys.stderr)
            return 2
    if args.batch_size is None:
        # Servers batch internally: give each a few hundred sequences per call so none waits on the others.
        args.batch_size = 256 * len(urls) if urls else EvalConfig().batch_size
    try:
        every, per_bench = parse_samples(args.samples)
    except ValueError as e:
        print(f"megaopd eval: {e}", file=sys.stderr)
        return 2
    cfg = EvalConfig(
        samples=every,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        seed=args.seed,
        use_chat_template=not args.no_chat_template,
        repetition=RepetitionConfig(window_chars=args.repetition_window),
        reward=RewardConfig(extract=args.extract),
    )
    # Check the benchmark files before exporting or loading a model: a typo should cost a second.
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    try:
        suites = resolve_benchmarks(names, args.data_dir, cfg.samples)
        unknown = set(per_bench) - {b.name for b in suites}
        if unknown:
            raise ValueError(f"--samples names {sorted(unknown)}, which --benchmarks does not evaluate")
        for b in suites:
            b.samples = per_bench.get(b.name, b.samples)
    except (ValueError, FileNotFoundError) as e:
        print(f"megaopd eval: {e}", file=sys.stderr)
        return 2

    from megaopd.models.checkpoint import is_megatron_checkpoint
    from megaopd.models.hf_io import load_tokenizer

    label = args.label or os.path.basename(ckpt)
    with contextlib.ExitStack() as cleanup:
        if urls:
            # The servers hold the model; only the tokenizer is read here (an HF folder, or the HF side
            # files of a Megatron checkpoint).
            from megaopd.eval.engines import engine_pool

            try:
                tokenizer = load_tokenizer(ckpt)
                engine = engine_pool(urls, request_timeout_s=args.engine_timeout, wait_s=args.engine_wait)
            except (FileNotFoundError, RuntimeError) as e:
                print(f"megaopd eval: {e}", file=sys.stderr)
                return 2
        else:
            # A megaopd Megatron checkpoint (training checkpoints RUN/checkpoints/step_N are ones too) also
            # holds config.json (its HF side files): test for it first.
            if is_megatron_checkpoint(ckpt):
                os.makedirs(out_dir, exist_ok=True)
                export_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="hf_export_", dir=out_dir))
                hf_dir = export_megatron_to_hf(ckpt, os.path.join(export_dir, "hf"))
            elif is_hf_dir(ckpt):
                hf_dir = ckpt
            else:
                print(
                    f"megaopd eval: {ckpt} is neither an HF folder (config.json) nor a megaopd Megatron "
                    f"checkpoint (megaopd_checkpoint.json)",
                    file=sys.stderr,
                )
                return 2
            tokenizer = load_tokenizer(hf_dir)
            engine = load_engine(hf_dir, args.batch_size, args.dtype)
        try:
            result = evaluate(EvalModel(engine, tokenizer, label), suites, cfg, out_dir=out_dir)
        except ValueError as e:  # out_dir holds another evaluation's generations
            print(f"megaopd eval: {e}", file=sys.stderr)
            return 2
    print(result.markdown())
    print(result.answers_line())
    warning = result.answers_warning("--extract ")
    if warning:
        print(f"megaopd eval: warning: {warning}", file=sys.stderr)
    print(f"written: {out_dir}/results.md, results.json, generations.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
