"""The package reads along the data's path, data -> rollout -> scoring -> losses -> sync -> trainer: no module
of one of these packages imports from a package later in that order (the trainer composes them all).
The other packages (config, parallel, models, ops, metrics, eval) are libraries any of them may use."""
import ast
import os

import megaopd

PATH = ["data", "rollout", "scoring", "losses", "sync", "trainer"]
ROOT = os.path.dirname(megaopd.__file__)


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.split(".")[1] for m in out if m.startswith("megaopd.") and len(m.split(".")) > 1}


def test_no_package_imports_from_one_later_on_the_data_path():
    violations = []
    for i, package in enumerate(PATH[:-1]):
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    later = sorted(p for p in _imports(path) if p in PATH[i + 1:])
                    if later:
                        violations.append(f"{os.path.relpath(path, ROOT)} imports {later}")
    assert not violations, violations


def test_trainer_class_stays_under_300_lines():
    """Issue 11's contract: the Trainer keeps the loop, the optimizer, checkpoints and the run log; what
    grows belongs in the modules along the data's path."""
    with open(os.path.join(ROOT, "trainer", "trainer.py")) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert cls.end_lineno - cls.lineno + 1 < 300, cls.end_lineno - cls.lineno + 1
