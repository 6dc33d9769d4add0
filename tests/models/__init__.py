"""Tests of megaopd.models: run with `pytest tests/models -x` (multi-process ones are marked slow)."""
