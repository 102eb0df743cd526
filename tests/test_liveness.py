"""Liveness of the processes behind pins and temporary entries: never a bare pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from jaxckpt.coord import _liveness
from jaxckpt.memory._memory_tier import MemoryTier
from jaxckpt.peer._server import PeerServer
from jaxckpt.peer._wire import TEMP_PREFIX


def fake_record(pid: int, *, start_cs: int | None = None, namespace=None, boot=None) -> str:
    """A record as `_liveness.record` writes it, with any field replaced."""
    _, real_start, real_ns, real_boot = _liveness.record().split(".")
    return ".".join(
        str(x)
        for x in (
            pid,
            real_start if start_cs is None else start_cs,
            real_ns if namespace is None else namespace,
            real_boot if boot is None else boot,
        )
    )


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_record_of_this_process_is_alive():
    assert not _liveness.is_gone(_liveness.record())


def test_exited_process_is_gone():
    pid = _exited_pid()
    assert _liveness.is_gone(fake_record(pid))


def test_reused_pid_is_gone():
    """A live pid with another start time is a later process: the writer is gone."""
    start = round(psutil.Process().create_time() * 100)
    assert _liveness.is_gone(fake_record(os.getpid(), start_cs=start - 500))


def test_other_namespace_or_boot_is_never_judged():
    """A pid of another container (pid namespace) or boot means nothing here."""
    gone = _exited_pid()
    assert not _liveness.is_gone(fake_record(gone, namespace="4026530000"))
    assert not _liveness.is_gone(fake_record(gone, boot="0123456789abcdef"))
    assert not _liveness.is_gone(f"{gone}")  # not a record: not ours to judge


def test_pin_is_judged_by_its_lock_not_by_a_pid(tmp_path: Path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    tier.step_dir(1).mkdir(parents=True)
    # A pin file named after a live pid (ours) that no process holds: a dead
    # writer whose pid was reused, or a writer from another pid namespace.
    (tier.step_dir(1) / f".pin-{os.getpid()}-deadbeef").write_text("")
    assert not tier.is_pinned(1)
    # Held by another process (its pid means nothing here): pinned while it lives.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from jaxckpt.memory._memory_tier import MemoryTier; "
            f"MemoryTier({str(tmp_path)!r}, 'run-a').pin(1); print('pinned', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "pinned"
        assert tier.is_pinned(1)
    finally:
        holder.kill()
        holder.wait()
    assert not tier.is_pinned(1)
    mine = tier.pin(1)
    assert tier.is_pinned(1)
    mine.release()
    assert not tier.is_pinned(1)


def test_peer_server_removes_only_temps_whose_writer_is_certainly_gone(tmp_path: Path):
    run = tmp_path / "run1"
    run.mkdir()
    start = round(psutil.Process().create_time() * 100)
    gone = run / f"{TEMP_PREFIX}{fake_record(_exited_pid())}-push-a"
    reused = run / f"{TEMP_PREFIX}{fake_record(os.getpid(), start_cs=start - 500)}-push-b"
    other_ns = run / f"{TEMP_PREFIX}{fake_record(_exited_pid(), namespace='1')}-push-c"
    mine = run / f"{TEMP_PREFIX}{_liveness.record()}-push-d"
    for p in (gone, reused, other_ns, mine):
        p.mkdir()
    with PeerServer(tmp_path, run_id="run1", token="t0k3n"):
        time.sleep(0.05)
        assert not gone.exists() and not reused.exists()
        assert other_ns.exists() and mine.exists()
