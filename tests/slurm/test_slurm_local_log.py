"""scripts/slurm_local.sh when slurmctld does not come up: it used to exit 1 with no word (issue 53: a machine
whose Slurm state names another cluster; slurmctld said "CLUSTER NAME MISMATCH" only in its own log). Now it
prints the end of that log and the fix. Tested on captured logs through the script's own function (the script
sourced: nothing starts), so the shared local cluster is never touched: no root, no Slurm needed."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "slurm_local.sh")

# What Slurm 22.05's slurmctld (Debian's slurm-wlm) writes to SlurmctldLogFile before it exits; the fatal text
# is the binary's own (`strings /usr/sbin/slurmctld`).
EARLIER = "[2026-11-28T10:00:00.000] slurmctld version 22.05.8 started on cluster megaopd-local\n"
MISMATCH = """[2026-11-29T09:12:01.371] error: Configured MailProg is invalid
[2026-11-29T09:12:01.372] fatal: CLUSTER NAME MISMATCH.
slurmctld has been started with "ClusterName=megaopd-local", but read "linux" from the state files in StateSaveLocation.
Running multiple clusters from a shared StateSaveLocation WILL CAUSE CORRUPTION.
Remove /var/spool/slurmctld/clustername to override this safety check if this is intentional \
(e.g., the ClusterName has changed).
"""
OTHER = "[2026-11-29T09:12:01.372] fatal: Unable to find slurm.conf SlurmctldHost for this machine\n"


def _failure(tmp_path, text: str, offset: int) -> subprocess.CompletedProcess:
    log = tmp_path / "slurmctld.log"
    log.write_text(text)
    return subprocess.run(
        ["bash", "-c", 'f=$1 log=$2 off=$3; set --; source "$f" && ctld_failure "$log" "$off" 1']
        + ["bash", SCRIPT, str(log), str(offset)],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("offset", [len(EARLIER), 0])
def test_a_state_folder_of_another_cluster_is_named_with_the_fix(tmp_path, offset):
    r = _failure(tmp_path, EARLIER + MISMATCH, offset)
    assert r.returncode == 1 and r.stdout == "", r
    assert "slurmctld is not running (it exited with status 1)" in r.stderr
    assert "  [2026-11-29T09:12:01.372] fatal: CLUSTER NAME MISMATCH." in r.stderr  # its log, indented
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("slurm_local: error: slurmctld refused its state folder: /var/spool/slurmctld/clustername")
    assert "remove /var/spool/slurmctld/clustername" in last and "run this script again" in last
    if offset:  # only what this run's slurmctld said
        assert "started on cluster" not in r.stderr


def test_any_other_death_prints_the_log_and_where_it_is(tmp_path):
    r = _failure(tmp_path, EARLIER + OTHER, len(EARLIER))
    assert r.returncode == 1
    assert "  " + OTHER.strip() in r.stderr and "started on cluster" not in r.stderr
    assert r.stderr.strip().endswith(
        f"fix what its log says above, then run this script again (all of it: {tmp_path}/slurmctld.log)"
    )


def test_sourcing_the_script_starts_nothing(tmp_path):
    sourced = 'f=$1; set --; source "$f" && type ctld_failure >/dev/null && echo sourced'
    r = subprocess.run(["bash", "-c", sourced, "bash", SCRIPT], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "sourced\n" and r.stderr == "", r
