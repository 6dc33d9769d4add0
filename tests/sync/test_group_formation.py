"""How DistributedWeightUpdater.connect ends when the weight-update group cannot form: this process hosts rank 0
of a real gloo rendezvous, and the engines' answers to /init_weights_update_group are stood in for (the calls
to a real `megaopd serve`: tests/rollout/test_weight_sync.py)."""

import subprocess
import sys
import threading
import time

import pytest

from megaopd.parallel.dist import find_free_port
from megaopd.rollout.client import EngineError, HttpEngine, HttpEngineConfig
from megaopd.sync import distributed
from megaopd.sync.distributed import DistributedUpdateConfig, DistributedWeightUpdater

TAKEN = "Process group name weight_update_group has already been created"


class _Answer:
    """An engine's answer to the join request: `error` (None: joined) after `after_s`; never, with held=True (an
    engine blocked in the rendezvous)."""

    def __init__(self, url: str, error: str | None, after_s: float = 0.0, held: bool = False):
        self.engine = HttpEngineConfig(url=url)
        self.error, self._done = error, threading.Event()
        if not held:
            threading.Timer(after_s, self._done.set).start()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


def _updater(monkeypatch, answers, world_size: int = 3) -> tuple[DistributedWeightUpdater, list[str]]:
    """An updater over len(answers[0]) engines whose k-th connect attempt gets answers[k]; the names tried."""
    engines = [HttpEngine(HttpEngineConfig(url=f"http://engine-{i}")) for i in range(len(answers[0]))]
    updater = DistributedWeightUpdater(engines, DistributedUpdateConfig(timeout_s=30))
    updater.world_size = world_size  # more ranks than ever join: the group never forms by itself
    tried = []

    def post_all(path, bodies):
        tried.append(bodies[0]["group_name"])
        return answers[len(tried) - 1]

    monkeypatch.setattr(updater, "_post_all", post_all)
    monkeypatch.setattr(updater, "_destroy_on_engines", lambda: None)
    return updater, tried


def test_a_taken_name_is_tried_again_when_every_engine_answered(monkeypatch):
    attempts = [[_Answer("http://a", TAKEN), _Answer("http://b", TAKEN, after_s=0.3)] for _ in range(3)]
    updater, tried = _updater(monkeypatch, attempts)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="already been created"):
        updater.connect()
    assert tried == ["weight_update_group", "weight_update_group_1", "weight_update_group_2"]
    assert time.monotonic() - t0 < 10 and updater.pg is None


def test_no_retry_while_an_engine_is_held_in_the_abandoned_rendezvous(monkeypatch):
    """Engine b joined (its call still blocks in the rendezvous this rank gave up): a second join request would
    queue behind it until that rendezvous times out, so connect raises at once instead of trying again."""
    updater, tried = _updater(monkeypatch, [[_Answer("http://a", TAKEN), _Answer("http://b", None, held=True)]])
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="http://a.*already been created"):
        updater.connect()
    assert tried == ["weight_update_group"]
    assert time.monotonic() - t0 < distributed._SETTLE_S + 5


def test_a_refusal_that_arrives_after_the_group_formed_is_tried_again(monkeypatch):
    """Under nccl rank 0's group forms once every rank reached the store, before an engine that then refuses the
    name has answered (stood in for here by a group of one): that group is destroyed, and the next name tried."""
    from torch.distributed.distributed_c10d import _world

    real = distributed.dist_group.init_custom_process_group
    monkeypatch.setattr(
        distributed.dist_group,
        "init_custom_process_group",
        lambda backend, addr, port, rank, world, name, timeout_s: real(
            "gloo", addr, port, 0, 1, name, timeout_s=timeout_s
        ),
    )
    updater, tried = _updater(monkeypatch, [[_Answer("http://a", TAKEN, after_s=0.5)], [_Answer("http://a", None)]])
    updater.connect()
    try:
        assert tried == ["weight_update_group", "weight_update_group_1"]
        assert updater.group_name == "weight_update_group_1"
        assert sorted(n for n in _world.pg_names.values() if n.startswith("weight_update_group")) == [
            "weight_update_group_1"
        ]
    finally:
        updater.close()


_RANK_1 = """
import sys
from megaopd.parallel import custom_group
pg = custom_group.init_custom_process_group("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, sys.argv[2], timeout_s=60)
print("joined", flush=True)
"""


@pytest.mark.slow
def test_a_group_that_forms_after_connect_gave_up_is_destroyed(monkeypatch):
    """One engine refused (connect raised) and another rank joins afterwards: the group the hosting thread then
    forms, which nobody uses, is destroyed by the updater's next connect() or close()."""
    from torch.distributed.distributed_c10d import _world

    port = find_free_port()
    monkeypatch.setattr(distributed, "find_free_port", lambda: port)
    updater, _ = _updater(monkeypatch, [[_Answer("http://a", "backend 'nccl' needs a GPU")]], world_size=2)
    before = set(threading.enumerate())  # the other tests' rendezvous threads wait out their timeouts
    with pytest.raises(EngineError, match="refused to join"):
        updater.connect()
    hosting = [t for t in set(threading.enumerate()) - before if t.name == "megaopd-weight-group"]
    assert len(hosting) == 1
    # The name connect() chose: "weight_update_group", or a numbered one when a group of that name is still
    # registered in this process (an earlier test's in the same pytest worker).
    joined = subprocess.run(
        [sys.executable, "-c", _RANK_1, str(port), updater.group_name], capture_output=True, text=True, timeout=90
    )
    assert joined.returncode == 0 and "joined" in joined.stdout, joined.stderr[-2000:]
    hosting[0].join(30)
    assert not hosting[0].is_alive() and len(updater._late) == 1
    updater.close()
    assert updater.group_name not in _world.pg_names.values()
