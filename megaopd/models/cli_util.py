"""Shared command-line behaviour of the model tools: one-line errors and non-zero exits."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from megaopd.models.hf_config import InputError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (prog: error: ...), exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_cli(prog: str, body: Callable[[], None]) -> int:
    """Runs body(); an InputError becomes one stderr line and exit code 2."""
    try:
        body()
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def report(message: str) -> None:
    """Prints a success line once per job (rank 0 under torchrun; always when run directly)."""
    if os.environ.get("RANK", "0") == "0":
        print(message)
