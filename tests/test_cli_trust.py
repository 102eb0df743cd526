"""`jaxckpt ls` and `verify` show quarantined memory copies and the kept area, so an
operator sees why a step is, or is not, restorable."""

from __future__ import annotations

import json

import orbax.checkpoint as ocp
from helpers import flip_slab_byte, manager, mesh_1d, save, sharded_state

import jaxckpt
from jaxckpt import cli
from jaxckpt.tiers import _memory_tier
from jaxckpt.tools import _trust


def jaxckpt_cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def _step_rows(text: str) -> dict[str, str]:
    return {line.split()[0]: line for line in text.splitlines() if line[:4].strip().isdigit()}


def test_a_quarantined_memory_copy_shows_in_ls_and_verify_with_its_reason(
    capsys, memory_root, ckpt_dir
):
    """Step 2 (durable, and in memory) has its memory copy damaged; the public
    `latest_restorable_step(verify=True)` quarantines it. The tools then show it as
    quarantined, with why, and count only the persisted copy."""
    state = sharded_state(mesh_1d())
    options = jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=2)
    h = jaxckpt.TieredCheckpointHandler(options)
    with manager(ckpt_dir, h) as mngr:
        for step in (1, 2, 3):
            save(mngr, step, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        run_id = h.inspect().memory.run_id
    part = _memory_tier.MemoryTier(memory_root, run_id).part_dir(2, 0)
    flip_slab_byte(part, "['w']", (0, 0), at=3, bit=0x08)
    with manager(ckpt_dir, jaxckpt.TieredCheckpointHandler(options)) as mngr:
        assert jaxckpt.latest_restorable_step(mngr, verify=True, delete_newer=False) == 3

    code, text = jaxckpt_cli(capsys, "ls", ckpt_dir, "--memory-root", memory_root)
    assert code == 0
    rows = _step_rows(text)
    assert "yes: persistent" in rows["2"] and "1 quarantined" in rows["2"]
    assert "yes: memory" in rows["3"]
    why = "checksum mismatch of chunk (0, 0) of ['w']; marked by process 0"
    assert (
        f"step 2: copy of part 0 in {memory_root} is quarantined ({why}); never offered "
        "to a restore" in text
    )
    code, out = jaxckpt_cli(capsys, "ls", ckpt_dir, "--memory-root", memory_root, "--json")
    report = json.loads(out)
    steps = {s["step"]: s for s in report["steps"]}
    expected = {
        "root": memory_root,
        "step": 2,
        "part": 0,
        "why": "checksum mismatch of chunk (0, 0) of ['w']",
        "marked_by": 0,
    }
    assert steps[2]["quarantined"] == [expected] and steps[3]["quarantined"] == []
    assert steps[2]["memory"] == {} and steps[2]["memory_copies"] == 0
    assert steps[2]["restorable_from"] == ["persistent"]
    assert report["quarantined"] == [expected]
    assert report["memory_roots"][0]["quarantined"] == [expected]

    # verify: the quarantined copy is known damage, apart from what it reads now.
    code, text = jaxckpt_cli(
        capsys, "verify", ckpt_dir, 2, "--memory-root", memory_root, "--no-progress"
    )
    assert code == 0, text  # the persisted copy is good; no new damage
    assert "1 good copy, 0 bad." in text
    assert (
        f"Quarantined earlier (known damage, not read, never offered to a restore): part 0 "
        f"in {memory_root}: {why}." in text
    )
    code, out = jaxckpt_cli(
        capsys, "verify", ckpt_dir, 2, "--memory-root", memory_root, "--no-progress", "--json"
    )
    report = json.loads(out)
    assert [c["tier"] for c in report["copies"]] == ["persistent"]
    assert report["quarantined"] == [expected] and report["ok"]


def test_a_quarantine_marker_without_a_reason_is_checked_by_verify(capsys, memory_root, ckpt_dir):
    """A marker an older jaxckpt left empty: `ls` says the reason is not recorded,
    `verify` reads the slab and says what is wrong with it now."""
    state = sharded_state(mesh_1d())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        part = h.inspect().memory.part_dir(1, 0)
    flip_slab_byte(part, "['w']", (0, 0))
    (part / ".corrupt").touch()
    code, text = jaxckpt_cli(capsys, "ls", ckpt_dir, "--memory-root", memory_root)
    assert "is quarantined (reason not recorded); never offered" in text
    assert "NO: part 0 has no copy in reach" in _step_rows(text)["1"]
    code, text = jaxckpt_cli(
        capsys, "verify", ckpt_dir, 1, "--memory-root", memory_root, "--no-progress"
    )
    assert code == 3  # no copy left in reach; and no new damage
    assert "not recorded; checked now: checksum mismatch of chunk (0, 0) of ['w']." in text


def _plain_manager(ckpt_dir, handler) -> ocp.CheckpointManager:
    """A plain manager whose garbage collection keeps one step (max_to_keep=1)."""
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("train", jaxckpt.TieredSave, handler)
    reg.add("train", jaxckpt.TieredRestore, handler)
    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    return ocp.CheckpointManager(ckpt_dir, handler_registry=reg, options=options)


def test_ls_shows_the_kept_step_and_that_it_is_put_back(capsys, memory_root, ckpt_dir):
    """max_to_keep=1 deletes the durable step 2 once step 3 is saved; its kept copy
    shows in `ls`, and after `latest_restorable_step` put it back, as a step again."""
    state = sharded_state(mesh_1d())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with _plain_manager(ckpt_dir, h) as mngr:
        for step in (1, 2, 3):
            save(mngr, step, state)
            mngr.wait_until_finished()
            h.wait_for_persistence()
        assert mngr.all_steps() == [3]

    code, text = jaxckpt_cli(capsys, "ls", ckpt_dir, "--memory-root", memory_root)
    assert code == 0 and "2" not in _step_rows(text)
    assert (
        "kept: step 2 in .jaxckpt-kept (complete: parts 0 of 1): its step directory was "
        "deleted by the manager; the next latest_restorable_step puts it back" in text
    )
    code, out = jaxckpt_cli(capsys, "ls", ckpt_dir, "--json")
    report = json.loads(out)
    (kept,) = report["kept"]
    assert kept["step"] == 2 and kept["complete"] and kept["parts"] == [0]
    assert not kept["step_dir_exists"] and kept["reinstated_next"]
    assert report["kept_area"] == str(ckpt_dir / ".jaxckpt-kept")

    h2 = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with _plain_manager(ckpt_dir, h2) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == 3
    code, text = jaxckpt_cli(capsys, "ls", ckpt_dir, "--memory-root", memory_root)
    assert "yes: persistent" in _step_rows(text)["2"]
    assert (
        "kept: step 2 in .jaxckpt-kept (complete: parts 0 of 1): hard links of its step "
        "directory's files (no extra space)" in text
    )


def test_the_kept_notes_say_why_a_kept_step_is_not_put_back():
    """The two cases a single-process save does not leave behind: a kept step some
    process's part is missing from, and one a newer durable step makes unneeded."""
    kept = {"step": 10, "name": "10", "parts": [0, 2, 3], "part_count": 4, "reinstated_next": False}
    incomplete = {**kept, "complete": False, "step_dir_exists": False, "newer_durable": None}
    superseded = {**kept, "parts": [0, 1, 2, 3], "complete": True}
    superseded |= {"step_dir_exists": False, "newer_durable": 12}
    assert _trust.kept_notes([incomplete, superseded], ".jaxckpt-kept") == [
        "kept: step 10 in .jaxckpt-kept (incomplete: parts 0,2-3 of 4): its step directory is "
        "gone; not put back until every part is there",
        "kept: step 10 in .jaxckpt-kept (complete: parts 0-3 of 4): its step directory is "
        "gone; not put back: step 12 is newer and durable",
    ]
