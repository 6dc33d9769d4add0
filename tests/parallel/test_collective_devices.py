"""Every collective's tensors live on the group's device (a CPU tensor in an NCCL collective fails on a GPU).

No CPU test can see a tensor on the wrong device (the CPU layer makes every device the CPU), so this is a
structural guard, read from the source: in any function that calls a tensor collective of
torch.distributed, every tensor made from scratch (torch.zeros/ones/empty/full/tensor/arange/rand*) names
its device. Tensors made *_like another, or moved with .to(device), inherit it. Object collectives
(broadcast_object_list, all_gather_object) pickle and are placed by torch itself; they are not checked.
The GPU check (scripts/gpu_check.sh) runs the same code under NCCL.
"""

import ast
import os

import megaopd

ROOT = os.path.dirname(megaopd.__file__)
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "gather",
    "scatter",
}
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor"}


def _calls(fn: ast.AST):
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def _is_collective(call: ast.Call) -> bool:
    f = call.func
    return f.attr in COLLECTIVES and isinstance(f.value, ast.Name) and f.value.id in ("dist", "torch_dist")


def _is_factory(call: ast.Call) -> bool:
    f = call.func
    return f.attr in FACTORIES and isinstance(f.value, ast.Name) and f.value.id == "torch"


def test_tensors_of_collectives_name_their_device():
    offenders = []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                calls = list(_calls(fn))
                if not any(_is_collective(c) for c in calls):
                    continue
                for c in calls:
                    if _is_factory(c) and not any(k.arg == "device" for k in c.keywords):
                        offenders.append(
                            f"{os.path.relpath(path, ROOT)}:{c.lineno} {fn.name}: torch.{c.func.attr}(...) "
                            f"without device="
                        )
    assert not offenders, "\n".join(offenders)
