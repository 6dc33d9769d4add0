"""Worker functions for tests/ops (module level so that spawned processes can import them)."""

import io

import torch
import torch.distributed as dist

from tests.ops import _cases


def run_all_cases(rank, world_size):
    """Every case of _cases.CASES on this rank's shard, over an explicit TP group of all ranks.

    Returned as torch.save bytes: tensors put on spawn's torch.multiprocessing queue travel as
    shared-memory handles that die with the worker, so the parent could not open them.
    """
    group = dist.new_group(ranks=list(range(world_size)))
    results = {case.name: _cases.run_case(case, rank, world_size, group) for case in _cases.CASES}
    if world_size == 4:
        # Two TP groups of 2 in one job ([0, 1] and [2, 3]): the ops must use the rank within the group
        # they are given, not the global rank. Every rank creates both groups (new_group is collective).
        subgroups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
        results["subgroups"] = {
            case.name: _cases.run_case(case, rank % 2, 2, subgroups[rank // 2]) for case in _cases.CASES[:2]
        }
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


def load(payload: bytes):
    return torch.load(io.BytesIO(payload), weights_only=True)
