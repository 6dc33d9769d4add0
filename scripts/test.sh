#!/usr/bin/env bash
# The test command of the README: installs what is missing, then runs the whole suite (slow tests too).
# Quick loop while developing: `pytest -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q "$@"
