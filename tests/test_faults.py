"""Kill -9 at every phase of a save, then restart: nothing restorable is lost or wrong.

Owner phases run in one process: a subprocess saves steps 1 and 2 (drained:
finalized and persisted), then step 3 with `JAXCKPT_FAULT=<phase>@3`, so it
SIGKILLs itself at that exact point of step 3's save (`support/faults.py`, a hook at
`jaxckpt._faults`' point). The
manager's own finalize (the rename of the step directory) is cut the same way
by wrapping Orbax's `AtomicRenameTemporaryPath.finalize` in the subprocess.
The test process is then the restarted job: a new handler and manager on the
same directories. For every phase and two tiers (memory as the crash left it;
memory lost too, so only persisted steps remain) it checks that

* the newest step reported restorable restores with exactly the saved values,
* step 2 (the last step saved before the crash) always restores exactly,
* the restarted job saves and restores the next step.

Peer phases need several processes: two 4-process runs kill the owner after
it pushed its replicas (`replicated`) and a replica holder in the middle of
receiving a push; a third run restores both from memory, from a peer after
the killed process's memory is lost, and from persistent storage alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orbax.checkpoint as ocp
import patience
import pytest
from helpers import (
    TEST_PYTHONPATH,
    abstract,
    assert_tree_equal,
    manager,
    mesh_1d,
    restore,
    save,
    sharded_state,
)
from test_bad_peers import Outcome, bounded, tally

import jaxckpt
from jaxckpt._options import TierOptions
from jaxckpt.persistent import _step_dirs

CRASH_STEP = 3
PHASES_ONE_PROCESS = [
    "snapshot",
    "memory_write",
    "memory_commit",
    "index",
    "finalize",  # Orbax: commit done, step directory not yet renamed
    "finalized",  # Orbax: step directory renamed, persistence not done
    "persist_write",
    "persist_commit",
]
# The newest restorable step after the crash, per tier; a set where timing decides.
NEWEST = {
    "memory": {
        "finalized": {3},
        "persist_write": {2, 3},  # step 3's finalize races with its persistence
        "persist_commit": {3},
    },
    "persistent": {
        "finalized": {2, 3},  # persistence may or may not win the race with the kill
        # Step 3, if finalized before the kill, is persisted by the restarted job (from
        # memory, at its first restore) before the node is lost.
        "persist_write": {2, 3},
        "persist_commit": {3},
    },
}


def state_for(step: int) -> dict:
    return {**sharded_state(mesh_1d(), seed=step), "step": step}


SAVE_AND_CRASH = """
import os, signal
from orbax.checkpoint._src.path import atomicity
from helpers import manager, save, sharded_state, mesh_1d
import faults
import jaxckpt

faults.install_from_env()  # JAXCKPT_FAULT kills this process at its point

memory_root, ckpt, fault = os.environ["MEMORY_ROOT"], os.environ["CKPT"], os.environ["ORBAX_FAULT"]
if fault:  # cut the manager's finalize of step 3 before or after its rename
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        ours = self._final_path.name == "3"
        if ours and fault == "finalize":
            os.kill(os.getpid(), signal.SIGKILL)
        await original(self, *args, **kwargs)
        if ours and fault == "finalized":
            os.kill(os.getpid(), signal.SIGKILL)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize

h = jaxckpt.TieredCheckpointHandler(
    jaxckpt.TierOptions(memory_root, run_id="faults", persist_every=1)
)
mngr = manager(ckpt, h)
for step in (1, 2, 3):
    save(mngr, step, {**sharded_state(mesh_1d(), seed=step), "step": step})
    if step == 2:  # steps 1 and 2 are finalized and persisted before step 3 starts
        mngr.wait_until_finished()
        h.wait_for_persistence()
mngr.wait_until_finished()
h.wait_for_persistence()
print("NO CRASH")
"""


def run_crashing(phase: str, memory_root: str, ckpt: str) -> subprocess.CompletedProcess:
    orbax_fault = phase if phase in ("finalize", "finalized") else ""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": TEST_PYTHONPATH,
        "MEMORY_ROOT": memory_root,
        "CKPT": ckpt,
        "ORBAX_FAULT": orbax_fault,
        "JAXCKPT_FAULT": "" if orbax_fault else f"{phase}@{CRASH_STEP}",
    }
    prelude = "import jax\njax.config.update('jax_num_cpu_devices', 8)\n"
    return patience.run(
        [sys.executable, "-c", prelude + textwrap.dedent(SAVE_AND_CRASH)],
        env=env,
        timeout=120,
    )


class Crashes(dict):
    """Each phase's crashed save, made the first time a test asks for it: a pytest-xdist
    worker crashes only the phases of the tests it runs."""

    def __init__(self, base: Path):
        super().__init__()
        self.base = base

    def __missing__(self, phase: str) -> tuple[subprocess.CompletedProcess, Path]:
        memory_root, ckpt = self.base / phase / "memory", self.base / phase / "ckpt"
        self[phase] = (run_crashing(phase, str(memory_root), str(ckpt)), self.base / phase)
        return self[phase]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Crashes:
    """Every phase's crashed save, left untouched: tests copy it."""
    return Crashes(tmp_path_factory.mktemp("crashes"))


def after_crash(crashed, phase: str, tmp_path: Path) -> tuple[str, Path]:
    """A copy of what the crash at `phase` left: (memory root, checkpoint directory)."""
    proc, left = crashed[phase]
    assert proc.returncode == -9, f"the fault did not fire:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    shutil.copytree(left, tmp_path / "job", symlinks=True)
    return str(tmp_path / "job" / "memory"), tmp_path / "job" / "ckpt"


def options(memory_root: str, **kw) -> TierOptions:
    return TierOptions(memory_root, run_id="faults", persist_every=1, **kw)


def newest_restorable(memory_root: str, ckpt: Path, label: str) -> tuple[int | None, Outcome]:
    """What a restarted job does: restore the latest step, or the newest the error names."""
    h = jaxckpt.TieredCheckpointHandler(options(memory_root))
    mngr = manager(ckpt, h)
    step = mngr.latest_step()
    outcome = bounded(lambda: restore(mngr, step, abstract(state_for(step))), state_for(step), h)
    if outcome.kind == "error" and isinstance(outcome.error, FileNotFoundError):
        found = re.search(r"newest restorable step is (\d+)", str(outcome.error))
        if found:
            step = int(found.group(1))
            outcome = bounded(
                lambda: restore(mngr, step, abstract(state_for(step))), state_for(step), h
            )
    tally(label, "restart", outcome)
    mngr.close()
    return step, outcome


def restores_exactly(memory_root: str, ckpt: Path, step: int) -> Outcome:
    h = jaxckpt.TieredCheckpointHandler(options(memory_root))
    with manager(ckpt, h) as mngr:
        return bounded(lambda: restore(mngr, step, abstract(state_for(step))), state_for(step), h)


@pytest.mark.parametrize("phase", PHASES_ONE_PROCESS)
def test_kill_owner_at_every_phase(phase, crashed, tmp_path):
    memory_root, ckpt = after_crash(crashed, phase, tmp_path)

    for tier in ("memory", "persistent"):
        if tier == "persistent":
            shutil.rmtree(memory_root, ignore_errors=True)  # the node is lost as well
        step, outcome = newest_restorable(memory_root, ckpt, f"kill_{phase}_{tier}")
        assert outcome.kind != "wrong", f"{phase}/{tier}: WRONG VALUES for step {step}"
        assert outcome.kind == "ok", f"{phase}/{tier}: {outcome.kind} {outcome.error!r}"
        assert step in NEWEST[tier].get(phase, {2}), f"{phase}/{tier}: newest is {step}"
        previous = restores_exactly(memory_root, ckpt, CRASH_STEP - 1)
        tally(f"kill_{phase}_{tier}_previous", tier, previous)
        assert previous.kind == "ok", f"{phase}/{tier}: step 2 lost: {previous}"

    # The restarted job goes on from the step it restored and saves the next one.
    h = jaxckpt.TieredCheckpointHandler(options(memory_root))
    with manager(ckpt, h) as mngr:
        for newer in [s for s in mngr.all_steps() if s > step]:
            mngr.delete(newer)  # unrestorable leftovers of the crash (the error says so)
        nxt = step + 1
        accepted = mngr.save(nxt, args=ocp.args.Composite(train=jaxckpt.TieredSave(state_for(nxt))))
        mngr.wait_until_finished()
        h.wait_for_persistence()
    assert accepted, (
        f"{phase}: after restoring step {step}, the manager skipped the save of step {nxt}: "
        f"an unrestorable step-{nxt} directory from before the crash is still there "
        f"(steps: {sorted(p.name for p in ckpt.iterdir())})"
    )
    after = restores_exactly(memory_root, ckpt, nxt)
    tally(f"kill_{phase}_next_save", "memory", after)
    assert after.kind == "ok", f"{phase}: the save after the restart: {after}"


def test_a_killed_saves_staging_slab_is_removed_by_the_prompt_restart(crashed, tmp_path):
    """A kill during a memory write leaves the step's whole slab in `<memory>/<run>/.staging/`.
    The restarted job removes it at once, young as it is (a hot spare is back within
    seconds), because the process that wrote it is gone; it saves on without it."""
    memory_root, ckpt = after_crash(crashed, "memory_write", tmp_path)
    staging = Path(memory_root) / "faults" / ".staging"
    leftovers = list(staging.iterdir())
    assert any(f"step_{CRASH_STEP}.part_0" in p.name for p in leftovers), (
        f"the crash at memory_write left no step-{CRASH_STEP} slab in {staging} (the fault moved?)"
    )
    h = jaxckpt.TieredCheckpointHandler(options(memory_root))
    with manager(ckpt, h) as mngr:
        for step in (10, 11, 12):
            save(mngr, step, state_for(step))
            mngr.wait_until_finished()
            h.wait_for_persistence()
        remaining = [p.name for p in leftovers if p.exists()]
        assert not remaining, f"left behind in {staging} by the killed process: {remaining}"
        assert_tree_equal(restore(mngr, 12, abstract(state_for(12))), state_for(12))


def test_a_killed_persists_staging_dirs_are_removed_once_old(crashed, tmp_path):
    """A kill during persistence leaves `<ckpt>/.jaxckpt-staging/...`: shared storage, where
    no process can tell whether another host's writer still runs, so the next job removes
    what is older than `timeout_s` (aged here by hand)."""
    memory_root, ckpt = after_crash(crashed, "persist_write", tmp_path)
    staging = ckpt / _step_dirs.STAGING_DIR
    leftovers = list(staging.iterdir())
    assert leftovers, f"the crash at persist_write left nothing in {staging} (the fault moved?)"
    for p in leftovers:
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    h = jaxckpt.TieredCheckpointHandler(options(memory_root))
    with manager(ckpt, h) as mngr:
        save(mngr, 10, state_for(10))
        mngr.wait_until_finished()
        h.wait_for_persistence()
    remaining = [p.name for p in leftovers if p.exists()]
    assert not remaining, f"left behind in {staging} by the killed process: {remaining}"


# ---- peers: several processes ------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_owner_after_push_and_holder_mid_receive(tmp_path):
    from multiproc import run

    domains = [f"node{i}" for i in range(4)]
    cases = {
        # Process 1 dies after pushing its replicas of step 3, before its index manifest.
        "owner_replicated": ({1: {"JAXCKPT_FAULT": f"replicated@{CRASH_STEP}@1"}}, 1),
        # Process 2 dies while it receives a replica of step 3 (16 bytes of a chunk in).
        "holder_receiving": ({2: {"MP_KILL_ON_RECEIVE": str(CRASH_STEP)}}, 2),
    }
    roots = [str(tmp_path / "hosts" / f"node{i}") for i in range(4)]  # shared by both runs
    runs = []
    for name, (env, killed) in cases.items():
        ckpt = str(tmp_path / name / "ckpt")
        args = {"ckpt": ckpt, "steps": [1, 2, 3], "drain_after": [2], "persist_every": 2}
        results = run("save_faulty", roots, domains, args, env=env, expect_ok=False, timeout=120)
        assert results[killed].returncode == -9, results[killed].output[-3000:]
        assert not (Path(ckpt) / str(CRASH_STEP)).exists()  # step 3 never finalized
        runs.append({"ckpt": ckpt, "lose": killed, "name": name})

    # One restarted job restores both runs from every tier; tiers in this order because
    # losing memory cannot be undone: all memory, the killed process's memory lost, all lost.
    results = run(
        "recover",
        roots,
        domains,
        {
            "runs": [{"ckpt": r["ckpt"], "lose": r["lose"]} for r in runs],
            "tiers": ["memory", "peer", "persistent"],
            "previous": CRASH_STEP - 1,
        },
        timeout=180,
    )
    wrong = hangs = 0
    for p, r in enumerate(results):
        assert r.result is not None, r.output[-4000:]
        for entry in r.result["recovered"]:
            label = f"mp_{runs[entry['run']]['name']}_{entry['tier']}"
            for key in ("newest", "previous"):
                got = entry[key]
                kind = "ok" if got.get("bad") == [] else ("wrong" if got.get("bad") else "error")
                wrong += kind == "wrong"
                if p == 0:
                    print(f"TALLY {label}_{key} tier={entry['tier']} outcome={kind}")
                assert kind == "ok", f"process {p} {label} {key}: {got}"
            assert entry["newest"]["step"] == CRASH_STEP - 1, entry
            tiers = set(entry["newest"].get("bytes_by_tier", {}))
            if entry["tier"] == "persistent":
                assert tiers == {"persistent"}, entry
            elif entry["tier"] == "peer" and p == entry["lose"]:
                assert "persistent" not in tiers, entry  # from a peer's memory
    assert wrong == 0 and hangs == 0
    # The peer services bound where TierOptions.peer_host said, and shared one secret
    # token per run that no log line ever shows.
    for p, r in enumerate(results):
        assert set(r.result["peer_hosts"]) == {"127.0.0.1"}
        tokens = r.result["tokens"]
        assert tokens and all(len(t) == 64 for t in tokens)
        assert tokens == results[0].result["tokens"]
        logged = "\n".join(ln for ln in r.output.splitlines() if not ln.startswith("RESULT "))
        assert not any(t in logged for t in tokens), f"process {p} logged a token"


# ---- a process killed during a multi-process save, restarted on fewer processes -------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["memory_commit", "replicated"])
def test_kill_during_multiprocess_save_then_restore_on_3_processes(phase, tmp_path):
    """4 processes save with one replica each; process 1 is SIGKILLed in the middle of step
    3's save (after its snapshot, before its index manifest). The job restarts with 3
    processes, the killed node's memory kept (node 3 left the job) or lost (node 1 left):
    step 2 comes back bitwise from memory and peers, step 3 is never read, nothing hangs,
    and the 3-process job saves and restores step 3 anew."""
    from multiproc import run

    hosts, ckpt = tmp_path / "crash" / "hosts", tmp_path / "crash" / "ckpt"
    roots = [str(hosts / f"node{i}") for i in range(4)]
    args = {"ckpt": str(ckpt), "steps": [1, 2, CRASH_STEP], "timeout_s": 30}
    env = {1: {"JAXCKPT_FAULT": f"{phase}@{CRASH_STEP}@1"}}
    saved = run(
        "save_until_killed",
        roots,
        [f"node{i}" for i in range(4)],
        args,
        env=env,
        expect_ok=False,
        timeout=120,
        worker="mp_kill_resize.py",
    )
    assert saved[1].returncode == -9, saved[1].output[-3000:]
    assert not (ckpt / str(CRASH_STEP)).exists()  # step 3 never finalized

    tried = wrong = hangs = 0
    for variant, nodes in {"kept": [0, 1, 2], "lost": [0, 2, 3]}.items():
        job = tmp_path / variant
        shutil.copytree(tmp_path / "crash", job, symlinks=True)
        if variant == "lost":
            shutil.rmtree(job / "hosts" / "node1")  # the killed node's memory is gone
        started = time.monotonic()
        results = run(
            "restart",
            [str(job / "hosts" / f"node{i}") for i in nodes],
            [f"node{i}" for i in nodes],
            {"ckpt": str(job / "ckpt"), "crashed_step": CRASH_STEP, "timeout_s": 30},
            expect_ok=False,
            timeout=180,
            worker="mp_kill_resize.py",
        )
        seconds = time.monotonic() - started
        slowest = max(
            (t["seconds"] for r in results if r.result for t in r.result["tries"]), default=0
        )
        print(f"RESTART {phase}/{variant}: {seconds:.1f} s in all, slowest restore {slowest:.1f} s")
        for p, r in enumerate(results):
            if r.result is None:  # killed by the run's timeout, or crashed
                hangs += "TIMEOUT" in r.output
                raise AssertionError(f"{phase}/{variant} process {p}:\n{r.output[-4000:]}")
            for t in r.result["tries"]:
                tried += 1
                wrong += bool(t.get("bad"))
            label = f"kill_mp_{phase}_{variant}"
            outcome = Outcome("ok" if r.result["restored"] == CRASH_STEP - 1 else "error", seconds)
            if p == 0:
                tally(label, "memory+peer", outcome)
            assert r.result["latest"] == CRASH_STEP - 1, (label, p, r.result)
            assert r.result["restored"] == CRASH_STEP - 1, (label, p, r.result["tries"])
            assert "persistent" not in r.result["tiers"], (label, p, r.result["tiers"])
            crashed = r.result["crashed"]
            assert "error" in crashed and "bad" not in crashed, (label, p, crashed)
            assert r.result["tries"][-1].get("bad") == [], (label, p, r.result["tries"][-1])
    print(f"TALLY kill_mp_{phase} restores_tried={tried} wrong={wrong} hangs={hangs}")
    assert wrong == 0 and hangs == 0
