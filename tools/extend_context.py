"""Extend a model's RoPE context in every folder the job loads it from (explicit, never done by a job).

    python tools/extend_context.py --recipe luffy $MODELS_DIR/Qwen2.5-Math-7B [$STUDENT_CKPT ...]
    python tools/extend_context.py --rope-theta 40000 --max-position-embeddings 16384 DIR [DIR ...]

Pass every folder of the student: the HF directory the rollout engines serve and, when the trainer loads a
converted checkpoint (STUDENT_CKPT), that folder too: engines and trainer must use the same rope_theta or
their log-probs disagree. Each config.json is rewritten in place (the original kept as config.json.orig);
every change is printed. Recipes and their sources: megaopd/config/context.py and docs/cluster.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaopd.config.context import RECIPES, extend_context, model_config_files  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="HF model directories and/or megaopd checkpoint folders")
    ap.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        help="luffy: rope_theta 40000, 16384 positions; open-r1: rope_theta 300000, 32768 positions",
    )
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--max-position-embeddings", type=int)
    args = ap.parse_args(argv)
    if args.recipe:
        if args.rope_theta or args.max_position_embeddings:
            ap.error("give either --recipe or --rope-theta with --max-position-embeddings, not both")
        recipe = RECIPES[args.recipe]
        theta, positions = recipe.rope_theta, recipe.max_position_embeddings
        print(f"recipe {args.recipe} ({recipe.source}): rope_theta {theta:g}, max_position_embeddings {positions}")
    elif args.rope_theta and args.max_position_embeddings:
        theta, positions = args.rope_theta, args.max_position_embeddings
    else:
        ap.error("choose --recipe luffy|open-r1, or give both --rope-theta and --max-position-embeddings")
    try:
        files = [p for folder in args.folders for p in model_config_files(folder)]
        for path in files:
            change = extend_context(path, theta, positions)
            if change is None:
                print(f"{path}: already rope_theta {theta:g}, max_position_embeddings {positions}")
            else:
                old, new = change
                print(
                    f"{path}: rope_theta {old['rope_theta']} -> {new['rope_theta']:g}, max_position_embeddings "
                    f"{old['max_position_embeddings']} -> {new['max_position_embeddings']} (original: {path}.orig)"
                )
    except (FileNotFoundError, ValueError) as e:
        print(f"extend_context: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
