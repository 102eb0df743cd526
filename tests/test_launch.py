"""Tests of the local launcher with tiny plain-Python children (no jax)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from jaxckpt.launch import (
    _events,
    _priority,
    _registry,
    _standby,
    _supervise,
    _throttle,
    _timeline,
)
from jaxckpt.launch import _launcher as launch

# A fake training process: one step event every few ms, its step kept in its memory root
# (the "memory tier"), restored from there at start, and the launcher's kill hook. As a
# hot spare (JAXCKPT_STANDBY=1) it leaves its pid and nice value in the markers, says it
# is ready and waits for its go line; after its first step it prints a timeline whose
# restore and compile overlap. SIGTERM (a JAX job's preemption notice) makes it stop after
# its next step, as the examples do: a "stopped" event, exit 0.
CHILD = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, time

    mode, steps, markers = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
    env = os.environ
    woken = None
    asked_to_stop = []
    signal.signal(signal.SIGTERM, lambda *_: asked_to_stop.append(True))
    if env.get("JAXCKPT_STANDBY") == "1":
        joined = env["JAXCKPT_COORDINATOR"]
        (markers / f"spare-{os.getpid()}").write_text(joined)
        (markers / f"nice-{os.getpid()}").write_text(str(os.nice(0)))
        print(json.dumps({"event": "standby", "process": int(env["JAXCKPT_PROCESS_ID"])}),
              flush=True)
        while mode == "busy-spare":  # prepares without end (never woken in its test)
            pass
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        env.update(json.loads(line)["env"])
        del env["JAXCKPT_STANDBY"]
        woken = joined
    pid, n = int(env["JAXCKPT_PROCESS_ID"]), int(env["JAXCKPT_NUM_PROCESSES"])
    root = pathlib.Path(env["JAXCKPT_MEMORY_ROOT"])
    root.mkdir(parents=True, exist_ok=True)

    def emit(event, **fields):
        print(json.dumps({"event": event, "process": pid, **fields}), flush=True)

    def once(name):
        # True the first time any process of any attempt asks for this marker.
        try:
            (markers / name).touch(exist_ok=False)
            return True
        except FileExistsError:
            return False

    emit("env", coordinator=env["JAXCKPT_COORDINATOR"], n=n, nice=os.nice(0),
         devices=env["JAXCKPT_CPU_DEVICES"], domain=env["JAXCKPT_FAILURE_DOMAIN"],
         memory_root=str(root), woken=woken,
         cache=env.get("JAX_COMPILATION_CACHE_DIR"),
         cache_min=env.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"))
    if mode == "port" and pid == 0 and once("port"):
        print("F0101 Failed to add port to server", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    step = start = 0
    if (root / "step").exists():
        step = start = int((root / "step").read_text())
        emit("restored", step=step, seconds=0.01, tier="memory")
    t = time.time()  # as if it had restored and compiled at once, then trained a step
    emit("timeline", phases={"restore": [t, t + 0.2], "compile": [t + 0.05, t + 0.25],
                             "first_step": [t + 0.25, t + 0.3]}, compile={"cache_hits": 1})
    while step < steps:
        time.sleep(0.02)
        step += 1
        print("some log line", flush=True)
        emit("step", step=step, loss=1.0 / step)
        (root / "step.tmp").write_text(str(step))
        os.replace(root / "step.tmp", root / "step")  # atomic: the launcher kills at any time
        if env.get("JAXCKPT_KILL_AT_STEP") == str(step) and env.get("JAXCKPT_KILL_PROCESS") == str(pid):
            # Like a JAX job in lockstep: every process has saved a step by now (in the
            # first attempt process k runs on node k).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(
                (root.parent / f"node{k}" / "step").exists() for k in range(n)
            ):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang" and pid == 1 and step == 3 and once("hang"):
            time.sleep(3600)
        if mode == "fail" and pid == 0 and step == start + 2:  # fails in every attempt
            sys.exit(3)
        if asked_to_stop:
            emit("stopped", step=step, nice=os.nice(0))
            break
    emit("done", step=step)
    """
)


@pytest.fixture
def run(tmp_path: pathlib.Path):
    """Runs the launcher on the fake child; returns (exit code, report)."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    markers = tmp_path / "markers"
    markers.mkdir()

    def go(*flags: str, mode: str = "ok", steps: int = 8) -> tuple[int, dict]:
        report = tmp_path / "report.json"
        argv = [*flags, "--memory-base", str(tmp_path / "mem"), "--json", str(report)]
        cmd = [sys.executable, str(child), mode, str(steps), str(markers)]
        code = launch.main([*argv, "--", *cmd])
        return code, json.loads(report.read_text())

    return go


def test_clean_run_passes_environment(run, capsys) -> None:
    code, report = run("-n", "3", "--cpu-devices", "4")
    assert code == 0 and report["success"] and report["restarts"] == 0
    assert report["failures"] == [] and report["attempts"][0]["last_step"] == 8
    events = [
        json.loads(line.split("] ", 1)[1])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("[p") and '"env"' in line
    ]
    assert sorted(e["process"] for e in events) == [0, 1, 2]
    port = report["attempts"][0]["port"]
    for e in events:
        assert e["coordinator"] == f"127.0.0.1:{port}" and e["n"] == 3 and e["devices"] == "4"
        assert e["domain"] == f"node{e['process']}"
        assert e["memory_root"].endswith(f"mem/node{e['process']}")


def test_kill_is_detected_and_restored(run, capsys) -> None:
    code, report = run("-n", "3", "--kill", "1@3")
    assert code == 0 and report["restarts"] == 1 and len(report["attempts"]) == 2
    (failure,) = report["failures"]
    assert failure["process"] == 1 and failure["kind"] == "signal"
    assert failure["status"] == "killed by SIGKILL" and not failure["node_lost"]
    assert 0 <= failure["detected_after_s"] < 2 and failure["last_step"] >= 3
    restart = failure["restart"]
    assert restart["restored"]["1"] == {
        "step": 3,
        "tier": "memory",
        "seconds": 0.01,
        "bytes_by_tier": None,
    }
    # A process that had not stepped yet when it was killed restores nothing (step 0).
    steps = [restart["restored"].get(str(i), {"step": 0})["step"] for i in range(3)]
    assert restart["restored_step"] == min(steps)
    assert restart["steps_lost"] == failure["last_step"] - restart["restored_step"]
    assert restart["outcome"] == "ok" and restart["first_step_after_s"] is not None
    out = capsys.readouterr().out
    assert "[p1] some log line" in out and "steps lost" in out


def test_lose_node_deletes_memory_and_shrinks(run) -> None:
    code, report = run("-n", "3", "--lose-node", "1@3", "--processes-after-failure", "2")
    assert code == 0
    (failure,) = report["failures"]
    assert failure["node_lost"] and failure["process"] == 1
    restart = failure["restart"]
    # Node 1 is gone; the job continues on nodes 0 and 2, whose memory survived.
    assert report["attempts"][1]["nodes"] == [0, 2]
    assert restart["processes"] == 2 and set(restart["restored"]) == {"0", "1"}
    assert report["attempts"][1]["num_processes"] == 2


def test_next_nodes() -> None:
    assert launch.next_nodes([0, 1, 2], None, None) == [0, 1, 2]
    assert launch.next_nodes([0, 1, 2], 1, None) == [0, 1, 2]  # a spare replaces node 1
    assert launch.next_nodes([0, 1, 2], 1, 2) == [0, 2]
    assert launch.next_nodes([0, 1, 2], None, 2) == [0, 1]
    assert launch.next_nodes([0, 2], None, 3) == [0, 2, 3]


def test_hang_is_detected_and_killed(run) -> None:
    code, report = run("-n", "2", "--hang-timeout", "2", mode="hang")
    assert code == 0
    (failure,) = report["failures"]
    assert failure["kind"] == "hang" and failure["process"] == 1
    assert failure["status"] == "still running" and failure["detected_after_s"] >= 2
    assert failure["restart"]["restored"]["1"]["step"] == 3


def test_max_restarts_exhausted_fails(run) -> None:
    code, report = run("-n", "2", "--max-restarts", "1", mode="fail")
    assert code == 1 and not report["success"]
    assert [a["outcome"] for a in report["attempts"]] == ["exit", "exit"]
    assert report["attempts"][0]["returncode"] == 3 and report["attempts"][1]["returncode"] == 3
    assert len(report["failures"]) == 2 and "restart" not in report["failures"][-1]


def test_port_in_use_is_retried_without_a_restart(run) -> None:
    code, report = run("-n", "2", "--max-restarts", "0", mode="port")
    assert code == 0 and report["restarts"] == 0 and report["failures"] == []
    assert [a["outcome"] for a in report["attempts"]] == ["port", "ok"]


def events_of(out: str, kind: str) -> list[dict]:
    """The ``kind`` events in the launcher's output, in order."""
    found = [_events.parse_event(line.split("] ", 1)[1]) for line in out.splitlines()
             if line.startswith("[p")]  # fmt: skip
    return [e for e in found if e and e["event"] == kind]


def test_restart_report_has_the_recovery_timeline(run, capsys) -> None:
    code, report = run("-n", "3", "--kill", "1@3")
    assert code == 0
    restart = report["failures"][0]["restart"]
    timeline = restart["timeline"]
    assert timeline["standby"] is False and timeline["detected_after_s"] is not None
    assert timeline["first_step_after_s"] == restart["first_step_after_s"]
    # Failure to first step = detection + the launcher's restart + the new run's start.
    parts = ("detected_after_s", "restart_after_s", "first_step_after_s")
    assert timeline["recovery_s"] == pytest.approx(sum(timeline[k] for k in parts), abs=2e-3)
    assert 0 <= timeline["restart_after_s"] < 5
    assert sorted(timeline["processes"]) == ["0", "1", "2"]
    for entry in timeline["processes"].values():
        phases = entry["phases"]
        assert list(phases) == ["compile", "restore", "first_step"]  # the usual order
        # Offsets from the start of the new run (the fake processes do not step in
        # lockstep, as a JAX job does: each has its own times).
        assert 0 < phases["restore"]["start"] < phases["first_step"]["end"] < 30
        assert phases["restore"]["seconds"] == pytest.approx(0.2, abs=2e-3)
    # The slowest process of each phase is the one that ended it last.
    for name, span in timeline["slowest"].items():
        ends = [p["phases"][name]["end"] for p in timeline["processes"].values()]
        assert span["end"] == max(ends)
    assert timeline["restore_s"] == pytest.approx(0.2, abs=2e-3)
    assert timeline["restore_compile_overlap_s"] == pytest.approx(0.15, abs=2e-3)
    assert timeline["compile_cache_hits"] == 3
    assert "timeline: detected" in capsys.readouterr().out


def test_compilation_cache_is_passed_to_every_process(run, capsys, tmp_path) -> None:
    run("-n", "2")
    envs = events_of(capsys.readouterr().out, "env")
    assert {e["cache"] for e in envs} == {str(tmp_path / "mem" / "compilation-cache")}
    assert {e["cache_min"] for e in envs} == {"0"}
    assert launch.compilation_cache_env("off", "/m") == {}
    assert launch.compilation_cache_env("/c", "/m", {}) == {
        "JAX_COMPILATION_CACHE_DIR": "/c",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    # What the user's environment sets already is kept.
    mine = {"JAX_COMPILATION_CACHE_DIR": "/mine", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}
    assert launch.compilation_cache_env(None, "/m", mine) == {}


def test_standby_spares_take_over_and_are_reaped(run, capsys, tmp_path) -> None:
    # Steps enough for the spares started once the restart trains to get going (their
    # markers) before the job ends, on a loaded machine too: uncapped, as a capped spare
    # takes seconds to start Python (the cap: the next test).
    code, report = run(
        *("-n", "2", "--standby", "--standby-cpu", "1", "--max-restarts", "2"),
        *("--kill", "1@3"),
        steps=150,
    )
    out = capsys.readouterr().out
    assert code == 0 and report["restarts"] == 1
    first, second = report["attempts"]
    assert not first["standby"] and second["standby"] and second["port"] != first["port"]
    assert "(hot spares)" in out
    woken = [e for e in events_of(out, "env") if e["woken"]]
    # Both processes of the restart were spares, started for the job they then ran.
    assert sorted(e["process"] for e in woken) == [0, 1]
    for e in woken:
        assert e["woken"] == e["coordinator"] == f"127.0.0.1:{second['port']}"
        assert e["memory_root"].endswith(f"mem/node{e['process']}")
    assert report["failures"][0]["restart"]["timeline"]["standby"] is True
    # The restarted run started spares of its own (a restart was left); unused, they
    # were killed with the launcher's end.
    spares = [int(p.name.removeprefix("spare-")) for p in (tmp_path / "markers").glob("spare-*")]
    assert len(spares) == 4
    deadline = time.monotonic() + 10
    while not all(map(_dead, spares)):
        assert time.monotonic() < deadline, "a spare outlived the launcher"
        time.sleep(0.05)


def test_shrink_then_grow_back_on_spares_when_the_node_registers(run, capsys, tmp_path) -> None:
    code, report = run(
        *("-n", "3", "--standby", "--lose-node", "2@3", "--processes-after-failure", "2"),
        *("--return-node", "2@5", "--grow-at-save"),
        # Uncapped: the spares started while a job trains leave their markers in time
        # (capped, starting Python takes them seconds); the demo runs with the cap.
        *("--standby-cpu", "1"),
        steps=200,  # 4 s: the registration and the stop come while the job trains
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    attempts = report["attempts"]
    assert [a["outcome"] for a in attempts] == ["signal", "stopped", "ok"]
    assert [a["nodes"] for a in attempts] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    assert [a["standby"] for a in attempts] == [False, True, True]
    assert attempts[1]["stop_requested_at"] is not None and attempts[1]["stopped"]
    assert len(report["failures"]) == 1 and report["restarts"] == 1
    (grow,) = report["grows"]
    assert grow["from_processes"] == 2 and grow["to_processes"] == 3
    assert grow["nodes_added"] == [2] and grow["restart"]["nodes"] == [0, 1, 2]
    timeline = grow["restart"]["timeline"]
    assert timeline["kind"] == "grow" and timeline["standby"] is True
    assert timeline["stopped_after_s"] >= 0 and timeline["recovery_s"] is not None
    assert "node2 registered" in out and "grow back in attempt 1" in out
    assert "stopped" in _timeline.format_timeline(timeline)
    # The CPU the job and the spares used while the job trained, counted from its first step.
    cpu = [a["cpu_s"] for a in attempts]
    assert all(c is not None and c["job"] >= 0 and c["standby"] >= 0 for c in cpu), cpu
    assert all(c["seconds"] > 0 for c in cpu), cpu
    # The first spares prepared at normal priority before the job started, then waited at
    # nice 19; those started while a job trained started at 19. Woken, each had nice 0
    # again (as root; without CAP_SYS_NICE the launcher says it cannot give it back).
    niced = [int(p.read_text()) for p in (tmp_path / "markers").glob("nice-*")]
    assert 0 in niced and _priority.NICEST in niced, niced
    woken = [e for e in events_of(out, "env") if e["woken"]]
    assert len(woken) == 5  # 2 processes after the loss, 3 after the grow
    if "cannot give process" not in out:
        assert {e["nice"] for e in woken} == {0}


def test_a_new_host_registers_in_the_directory(run, capsys, tmp_path) -> None:
    register = tmp_path / "hosts"
    _registry.register(str(register), 7)  # a host that is up before the job needs it
    (register / "notes.txt").write_text("not a node")
    code, report = run(
        *("-n", "2", "--lose-node", "1@3", "--processes-after-failure", "1"),
        *("--register-dir", str(register), "--grow-at-save"),
        steps=100,
    )
    assert code == 0, capsys.readouterr().out[-3000:]
    assert [a["nodes"] for a in report["attempts"]] == [[0, 1], [0], [0, 7]]
    assert report["grows"][0]["nodes_added"] == [7]
    assert sorted(p.name for p in register.iterdir()) == ["notes.txt"]  # node7 was taken


def test_registry_takes_each_node_once_and_polls_at_most_every_half_second(tmp_path) -> None:
    registry = _registry.Registry(str(tmp_path / "r"))
    _registry.register(registry.directory, 3)
    _registry.register(registry.directory, 1)
    assert registry.take() == [1, 3]
    _registry.register(registry.directory, 4)
    assert registry.take() == []  # within POLL_S of the last read
    time.sleep(_registry.POLL_S)
    assert registry.take() == [4] and registry.take() == []


def test_spares_wait_at_a_low_priority_and_get_it_back(tmp_path) -> None:
    """At nice 19 in the idle scheduling class (a waking job thread preempts them at
    once); woken, at nice 0 in the normal class. A middle nice value keeps the normal
    class."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    own_autogroup = pathlib.Path("/proc/self/autogroup")
    autogroup_before = own_autogroup.read_text() if own_autogroup.exists() else None
    with _supervise.ProcessSet(sleeper, [{}], nice=_priority.NICEST) as procs:
        pid = procs.procs[0].pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == _priority.NICEST
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        # In the starter's session (one autogroup, where the idle class weighs against
        # the job's threads), in a process group of its own; the autogroup keeps its nice.
        assert os.getsid(pid) == os.getsid(0) and os.getpgid(pid) == pid
        if autogroup_before is not None:  # where the kernel schedules sessions first
            assert own_autogroup.read_text() == autogroup_before
        refused = procs.set_priority(0)
        if refused:  # not root: raising a priority needs CAP_SYS_NICE
            assert "CAP_SYS_NICE" in refused[0]
        else:
            assert os.getpriority(os.PRIO_PROCESS, pid) == 0
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
            assert procs.set_priority(10) == []  # lower again, but not the nicest
            assert os.getpriority(os.PRIO_PROCESS, pid) == 10
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    with pytest.raises(ValueError, match="nice value"):
        _priority.set_priority(os.getpid(), 20)


def test_spares_are_held_to_their_cpu_share_while_the_job_trains(run, tmp_path) -> None:
    """A spare that never stops preparing takes no more than about ``--standby-cpu`` of a
    CPU while the job trains (a job that mostly sleeps: all the rest would be its)."""
    code, report = run(
        "-n", "1", "--standby", "--standby-cpu", "0.05", mode="busy-spare", steps=100
    )
    assert code == 0
    cpu = report["attempts"][0]["cpu_s"]
    assert cpu["seconds"] > 1.0 and cpu["standby"] / cpu["seconds"] < 0.2, cpu
    # Capped (stopped most of the time) or not, the spare ends with the launcher.
    spares = [int(p.name.removeprefix("spare-")) for p in (tmp_path / "markers").glob("spare-*")]
    assert len(spares) == 1
    deadline = time.monotonic() + 10
    while not _dead(spares[0]):
        assert time.monotonic() < deadline, "a capped spare outlived the launcher"
        time.sleep(0.05)


def _state(pid: int) -> str:
    return psutil.Process(pid).status()


def test_throttle_holds_spares_to_their_share_and_continues_them() -> None:
    """A busy spare under the cap gets about its share of a CPU (never much more), runs
    freely once the cap ends, and a spare that dies meanwhile stops nothing."""
    spinner = [sys.executable, "-c", "while True: pass"]
    with _supervise.ProcessSet(spinner, [{}, {}]) as procs:
        busy, doomed = (psutil.Process(p.pid) for p in procs.procs)
        cap = _throttle.Throttle(0.1, period_s=0.05)
        with cap.running(lambda: [p.pid for p in procs.procs]):
            time.sleep(0.2)
            doomed.kill()
            before, start = sum(busy.cpu_times()[:2]), time.monotonic()
            time.sleep(1.5)
            used = sum(busy.cpu_times()[:2]) - before
            share = used / (time.monotonic() - start)
        # 0.1 of the time runnable; a loaded machine gives less, never much more.
        assert share < 0.3, share
        assert _state(busy.pid) != psutil.STATUS_STOPPED
        before = sum(busy.cpu_times()[:2])
        time.sleep(0.5)
        assert sum(busy.cpu_times()[:2]) - before > 0.05  # running again, uncapped
    with pytest.raises(ValueError, match="CPU share"):
        _throttle.Throttle(0)


def _exited(procs: list[psutil.Process]) -> bool:
    """Whether every process in `procs` has exited (a zombie until its parent reaps it)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE:
                return False
    return True


def test_a_spare_job_that_cannot_take_over_says_why(capsys) -> None:
    """A restart finds its spare job dead: the launcher drops it (the restart starts
    processes of its own) and prints its exit codes and its last lines."""
    exits = [sys.executable, "-c", "print('spare: out of luck', flush=True); raise SystemExit(3)"]
    standby = _standby.Standby(exits, cpu_devices=1, env={}, nice=0)
    try:
        before = psutil.Process().children()
        standby.fill([2])
        spares = [p for p in psutil.Process().children() if p not in before]  # fill's
        deadline = time.monotonic() + 30
        while not _exited(spares) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert standby.take(2) is None
    finally:
        standby.close()
    out = capsys.readouterr().out
    assert "the spare job of 2 processes cannot take over (exit codes [3, 3])" in out, out
    assert "[p0] spare: out of luck" in out and "[p1] spare: out of luck" in out, out


def test_a_stopped_spare_whose_launcher_died_ends(tmp_path) -> None:
    """The launcher dies while its cap holds a spare stopped: the spare's process group is
    orphaned, and the kernel's SIGHUP ends it (it is not left stopped for ever). One that
    had not stopped yet as the launcher died is not signalled (see `_throttle`)."""
    launcher = textwrap.dedent(
        """
        import os, signal, sys, time
        from jaxckpt.launch import _supervise
        procs = _supervise.ProcessSet([sys.executable, "-c", "import time; time.sleep(60)"], [{}])
        print(procs.procs[0].pid, flush=True)
        pid = procs.procs[0].pid
        os.killpg(pid, signal.SIGSTOP)
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # stopped, not only signalled
        os._exit(0)  # dies with the spare stopped, cleaning nothing up
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60, check=True
    )
    spare = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(spare).status() == psutil.STATUS_ZOMBIE:
                break  # ended; its new parent reaps it when it does
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"spare {spare} still {psutil.Process(spare).status()} after its launcher died")


def test_throttle_continues_what_it_stopped_when_the_body_fails() -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    with _supervise.ProcessSet(sleeper, [{}]) as procs:
        pid = procs.procs[0].pid
        seen = []
        cap = _throttle.Throttle(0.01, period_s=0.2)
        with pytest.raises(RuntimeError, match="body"), cap.running(lambda: [pid]):
            deadline = time.monotonic() + 10
            while _state(pid) != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(_state(pid))
            raise RuntimeError("the body failed")
        assert seen == [psutil.STATUS_STOPPED]
        assert _state(pid) != psutil.STATUS_STOPPED


def test_parsing_helpers() -> None:
    assert _events.parse_event('{"event": "step", "step": 3}') == {"event": "step", "step": 3}
    assert _events.parse_event("{not json") is None
    assert _events.parse_event('{"no": "event"}') is None
    assert launch.parse_injection("2@7") == (2, 7)
    with pytest.raises(Exception, match="PROCESS@STEP"):
        launch.parse_injection("2")
    assert launch.describe_returncode(-9) == "killed by SIGKILL"
    assert launch.describe_returncode(3) == "exit 3"
    with pytest.raises(SystemExit):
        launch.main(["-n", "2"])  # no command
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--kill", "5@1", "--", "true"])  # no such process


@pytest.mark.parametrize("share", ["0", "1.5", "-0.1"])
def test_a_cpu_cap_outside_zero_to_one_is_refused(share, capsys) -> None:
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", "--standby", "--standby-cpu", share, "--", "true"])
    assert "--standby-cpu must be in (0, 1]" in capsys.readouterr().err


def test_event_lines_round_trip_and_leave_out_unset_optional_fields() -> None:
    restored = _events.RestoredEvent(step=3, seconds=0.5, process=1, tier="memory")
    line = _events.format_event(restored)
    assert json.loads(line) == {
        "event": "restored",
        "step": 3,
        "seconds": 0.5,
        "process": 1,
        "tier": "memory",
    }
    assert _events.parse_event(line) == restored.to_dict()
    counted = dataclasses.replace(restored, bytes_by_tier={"peer": 8})
    assert _events.parse_event(_events.format_event(counted))["bytes_by_tier"] == {"peer": 8}
    # A field without a default is always written, None included.
    start = _events.StartEvent(0, 1, 2, {"data": 1, "fsdp": 2}, None)
    assert json.loads(_events.format_event(start))["compilation_cache"] is None
    # The kinds the launcher reads, and every kind named once.
    kinds = [cls.kind for cls in _events.Event.__subclasses__()]
    assert {"step", "restored", "timeline"} <= set(kinds) and len(kinds) == len(set(kinds))


def test_the_launcher_imports_nothing_of_the_core_nor_jax() -> None:
    # Read from the source: importing jaxckpt.launch imports jaxckpt itself, so
    # sys.modules cannot tell. A launched job's processes import the schema, not the reverse.
    package = pathlib.Path(_events.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("jax", "jaxlib", "orbax"), (path.name, name)
                if name.split(".")[0] == "jaxckpt":
                    assert name.startswith("jaxckpt.launch"), (path.name, name)


def test_process_set_reports_the_first_failure() -> None:
    code = "import os, sys; sys.exit(int(os.environ['CODE']))"
    envs = [{"CODE": "0"}, {"CODE": "3"}]
    with _supervise.ProcessSet([sys.executable, "-c", code], envs) as ps:
        assert ps.wait(time.monotonic() + 60, poll_s=0.05) == "process 1 exited with 3"
    with _supervise.ProcessSet([sys.executable, "-c", code], envs[:1]) as ps:
        assert ps.wait(time.monotonic() + 60, poll_s=0.05) is None


def test_process_set_kills_whole_groups_and_bounds_its_wait(tmp_path) -> None:
    # Each process starts a grandchild that would outlive it; killing the set ends both.
    script = (
        "import os, pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['WHO']).write_text(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    files = [tmp_path / "p0", tmp_path / "p1"]
    with _supervise.ProcessSet(
        [sys.executable, "-c", script], [{"WHO": "p0"}, {"WHO": "p1"}]
    ) as ps:
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and ps.codes() == [None, None]
            time.sleep(0.05)
        ticks: list[None] = []
        why = ps.wait(time.monotonic() + 0.2, poll_s=0.05, tick=lambda: ticks.append(None))
        assert why == "the run passed its deadline" and len(ticks) >= 2
    assert ps.codes() == [-signal.SIGKILL, -signal.SIGKILL]
    grandchildren = [int(f.read_text()) for f in files]
    deadline = time.monotonic() + 10
    while not all(map(_dead, grandchildren)):
        assert time.monotonic() < deadline, "a grandchild outlived the kill"
        time.sleep(0.05)


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_port_retries_are_bounded() -> None:
    ports = _supervise.PortRetries(2)
    assert not ports.retry(False)
    assert ports.retry(True) and ports.retry(True) and not ports.retry(True)
    assert _supervise.port_in_use("F0101 Failed to add port to server")
    assert 0 < _supervise.free_port() < 65536
