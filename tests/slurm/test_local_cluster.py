"""scripts/slurm_local.sh brings the simulated cluster back on a machine made from a copy of this one's disk.

What such a machine has: the daemons' pid files, naming pids that are by now other processes (on CI: the test
workers themselves); the namespace files under /run/netns with no namespace mounted on them; no bridge and no
veth pairs; the config unchanged, so nothing is torn down first. The script once trusted all of it: it took a
test worker for sim1's slurmd, never started that node, and waited 120 s for a node that never answered. And
a daemon it starts must not inherit its run lock, or the next run waits for good.

Slow (it kills and restarts the cluster's daemons, ~15 s); in the slurm group, so no other Slurm test runs
while it does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.slurm.test_rehearse import NODES, ROOT, sim_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "scripts", "slurm_local.sh")


def _pids(name):
    r = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _states():
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
    return dict(line.split() for line in r.stdout.splitlines() if line.strip())


def test_cluster_comes_back_from_a_copied_disk(sim_cluster):  # noqa: F811
    # What a stop without shutdown leaves: every daemon gone at once.
    for name in ("slurmctld", "slurmd", "munged"):
        for pid in _pids(name):
            os.kill(pid, signal.SIGKILL)
    # What a copy of the disk does not carry: the mounted namespaces, the links.
    for node in NODES:
        subprocess.run(["umount", f"/run/netns/megaopd-{node}"], capture_output=True)
    if subprocess.run(["mountpoint", "-q", "/run/netns"]).returncode == 0:
        subprocess.run(["umount", "/run/netns"], check=True)
    for link in ("mopd-v1", "mopd-v2", "megaopd-br0"):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    assert all(os.path.exists(f"/run/netns/megaopd-{n}") for n in NODES)
    # Pid files naming live processes that are not the daemons.
    strangers = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    try:
        for path, proc in zip(("/run/slurmd-sim1.pid", "/run/slurmctld.pid"), strangers):
            with open(path, "w") as f:
                f.write(f"{proc.pid}\n")
        t0 = time.time()
        r = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert all(p.poll() is None for p in strangers), "slurm_local.sh killed a process its stale pid file named"
        states = _states()
        assert all(states.get(n) in ("idle", "mixed", "allocated") for n in NODES), states
        print(f"cluster back in {time.time() - t0:.1f} s")
        # The daemons it started (munged among them, restarted above) must not hold its run lock: the next run
        # would wait for it for good.
        again = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        for p in strangers:
            p.kill()
            p.wait()
