"""init_custom_process_group (the trainer <-> engines weight-update group) under torchrun's environment.

torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in every rank; torch's tcp:// rendezvous then makes rank 0 a
client of the agent's store instead of the host of its own, and the group never formed: the trainer's rank 0
and every engine waited in the rendezvous until the timeout (seen in a rehearsed 2-node job, docs/cluster.md).
Two processes here, both with that environment, form the group and all_reduce over it."""

import os
import subprocess
import sys

import pytest

from megaopd.parallel.dist import find_free_port

_RANK = """
import sys, torch
from megaopd.parallel.custom_group import destroy_custom_process_group, init_custom_process_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
pg = init_custom_process_group("gloo", "127.0.0.1", port, rank, 2, "weight_update_group", timeout_s=30)
t = torch.tensor([rank + 1.0])
torch.distributed.all_reduce(t, group=pg)
# Torn down as the trainer and `megaopd serve` do on close: a process that exits holding a gloo group can abort
# in its exit handlers ("terminate called without an active exception", seen once in CI under load).
destroy_custom_process_group(pg)
print(t.item())
"""


@pytest.mark.slow  # two processes that import torch
def test_the_group_forms_under_torchrun_environment():
    port = find_free_port()
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}: " + err.decode()[-2000:]
        assert out.decode().split()[-1] == "3.0"
