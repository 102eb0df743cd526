"""The background threads: one persistence worker at a time, failures that are
reported where they happen (not in the user's callback, not lost in a future)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from helpers import attach_peers, manager, mesh_1d, save, sharded_state

import jaxckpt
from jaxckpt.tiers import _memory_tier, _persist_job, _persister


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


@dataclasses.dataclass(frozen=True)
class FakeManifest:
    step: int
    owner: int = 0


def fake_job(step: int) -> _persister.PersistJob:
    return _persister.PersistJob(FakeManifest(step), Path("src"), Path("item"), Path("final"))  # type: ignore[arg-type]


def test_close_after_a_drain_timeout_never_starts_a_second_worker():
    gate = threading.Event()
    running: list[int] = []
    overlap: list[tuple[int, ...]] = []
    done: list[int] = []
    workers: list[threading.Thread] = []  # the thread each job ran on
    lock = threading.Lock()

    class Store:
        """Persists nothing: records each job, holding step 1 until the gate opens."""

        def persist(self, job, **kwargs):
            with lock:
                running.append(job.manifest.step)
                workers.append(threading.current_thread())
                if len(running) > 1:
                    overlap.append(tuple(running))
            if job.manifest.step == 1:
                assert gate.wait(30)
            time.sleep(0.05)
            with lock:
                running.remove(job.manifest.step)
                done.append(job.manifest.step)
            return {"event": "persist", "step": job.manifest.step}

    p = _persister.Persister(None, timeout_s=1.0, store_at=lambda path: Store())
    p.submit(fake_job(1))
    with pytest.raises(TimeoutError, match=r"steps \[1\]"):
        p.close()  # step 1 is stuck: the drain gives up after 1 s
    p.submit(fake_job(2))  # goes to the same worker, after step 1; not dropped
    p.submit(fake_job(3))
    gate.set()
    p.drain(timeout_s=10)
    assert done == [1, 2, 3] and not overlap
    assert workers[1] is workers[0] and workers[2] is workers[0]  # no second worker
    p.close()
    workers[0].join(timeout=30)
    assert not workers[0].is_alive(), "the worker did not stop"
    p.submit(fake_job(4))  # a closed persister starts a fresh worker
    p.drain(timeout_s=10)
    assert workers[3] is not workers[0]
    assert done[-1] == 4
    p.close()


def test_a_failing_metrics_callback_fails_neither_save_nor_persist(memory_root, ckpt_dir):
    events = []

    def on_metrics(metrics):
        events.append(metrics["event"])
        raise RuntimeError("the user's dashboard is down")

    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=1), on_metrics=on_metrics
    )
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, sharded_state(mesh_1d()))
        h.wait_for_persistence()  # no "failed to persist"
        assert (ckpt_dir / "1" / "train" / "part_00000" / "manifest.json").exists()
        assert mngr.all_steps() == [1]
    assert events == ["save", "persist"]


def test_memory_retention_failure_is_reported(memory_root, ckpt_dir, monkeypatch):
    def broken(self, keep, upto, pinned=()):
        raise PermissionError(13, "Permission denied", str(self.run_dir))

    monkeypatch.setattr(_memory_tier.MemoryTier, "retain", broken)
    h = handler(memory_root, persist_every=1000)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, sharded_state(mesh_1d()))
        with pytest.raises(OSError, match=r"Memory retention after step 1 .*Permission denied"):
            h.wait_for_persistence()
        h.wait_for_persistence()  # reported once


def test_run_file_records_the_failure_domain(tmp_path, caplog):
    tier = _memory_tier.MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0, "rack-7")
    assert json.loads((tier.run_dir / "RUN.json").read_text())["failure_domain"] == "rack-7"
    tier.prepare("ckpt", 1, "rack-7")
    assert "failure domain" not in caplog.text
    tier.prepare("ckpt", 2, "rack-9")  # shares the host's tmpfs, declares another domain
    assert "'rack-7'" in caplog.text and "'rack-9'" in caplog.text


def test_wait_for_persistence_waits_for_a_commit_still_running(memory_root, ckpt_dir, monkeypatch):
    """An asynchronous manager's save() returns before its commit runs; the commit queues
    the persistence, and wait_for_persistence() waits for it all the same."""
    import time as _time

    from helpers import manager, mesh_1d, save, sharded_state

    import jaxckpt
    from jaxckpt.tiers import _slab

    write = _slab.write

    def slow(*args, **kwargs):
        _time.sleep(1.0)
        return write(*args, **kwargs)

    monkeypatch.setattr(_slab, "write", slow)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, sharded_state(mesh_1d()))
        h.wait_for_persistence()
        assert h.last_persist_metrics.get("step") == 1
        assert (ckpt_dir / "1" / "train" / "part_00000").is_dir()


class _SlowPeers:
    """Stands in for the peer service of a one-process test: a push that takes a while."""

    holders: dict[int, list[int]] = {}
    run_id = "slow-peers"  # the run they were met for

    def __init__(self, writing: list[int]):
        self.writing, self.during_push, self.pushed = writing, None, []

    def holders_with(self, partners: object) -> tuple[int, ...]:
        return ()

    async def push_replicas(self, part: Path, step: int, pi: int, holders: object = None) -> int:
        import asyncio

        await asyncio.sleep(0.5)
        self.during_push = list(self.writing)
        self.pushed.append(step)
        return 0

    def redact(self, text: str) -> str:
        return text

    def close(self) -> None:
        pass


def test_persistence_starts_once_the_part_is_on_its_peers(memory_root, ckpt_dir, monkeypatch):
    """A step due for persistence is pushed to its peers first: persisting beside the
    push would share the cores and the network with it."""
    writing: list[int] = []
    write = _persist_job.write_chunks

    async def spy(manifest, *args, **kwargs):
        writing.append(manifest.step)
        return await write(manifest, *args, **kwargs)

    monkeypatch.setattr(_persist_job, "write_chunks", spy)
    peers = _SlowPeers(writing)
    h = handler(memory_root, persist_every=1, replicas=1, run_id=peers.run_id)
    attach_peers(h, peers, monkeypatch)  # met already: the save's meeting finds them
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, sharded_state(mesh_1d()))
        h.wait_for_persistence()
    assert peers.pushed == [1] and peers.during_push == []  # nothing persisted meanwhile
    assert writing == [1]
    assert (ckpt_dir / "1" / "train" / "part_00000").is_dir()
