"""One process saving every step (figures 10a-f): a small state, a short step.

The two-process figures (1a-d) save 0.47 GiB a process behind a long step; a smaller,
shorter job shows what a save costs beyond its bytes. Here one process (its CPU
devices, no replicas) trains the benchmark's MLP with a 192 MiB state
(`--solo-state-gib`) and runs, in `--solo-rounds` rounds, the training loop without
saving, with the overlapped floor (`_floor`: the own shards held, copied and
checksummed on one background thread behind the next step), with a jaxckpt save every
step (copying into the slab in `save()`, the CPU default, and holding the arrays while
the commit copies them: `hold_cpu_arrays`) and with an Orbax async save every step. The rounds interleave the loops, so a
noisy neighbour slows them alike. Then the fixed cost of one save: back-to-back
`mngr.save()` calls of a 1 MiB state with jaxckpt, against Orbax's CheckpointManager
saving a trivial item (a one-key JSON), each call waiting for the previous save as the
manager does; the median time a call takes, interleaved the same way. Each round also
trains beside a stand-in hot spare that compiles without pause at the launcher's waiting
priority and CPU cap (`_spare`, figure 10f), in blocks of steps with the stand-in
capped and stopped in turn.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxckpt.bench import _floor, _spare, _state
from jaxckpt.bench._managers import Jaxckpt, manager_options, orbax_manager

TINY_BYTES: Final = 1 << 20  # the state whose saves measure the fixed cost
_TINY_SAVES: Final = 24  # per round; the first few of each warm up


def run(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    work: Path,
    loop: Callable[..., dict[str, list[float]]],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every round's loops (step and save times) and fixed costs, in one process."""
    rounds: list[dict[str, Any]] = []
    memory_root.mkdir(parents=True, exist_ok=True)  # the floor maps its file there
    for r in range(cfg["solo_rounds"]):
        progress(f"one process, a save every step: round {r + 1} of {cfg['solo_rounds']}")
        loops = {"train": loop(tr, cfg["steps"])}
        with _spare.beside() as spare:
            # Twice the steps of a loop a side: the blocks are short, the ratio small.
            loops["beside_spare"], loops["spare_stopped"] = spare.alternate(
                lambda n: loop(tr, n), 2 * cfg["steps"]
            )
        loops["floor"] = _floor_loop(cfg, tr, memory_root, loop)
        loops["jaxckpt"] = _jaxckpt_loop(cfg, tr, memory_root, work / f"solo-{r}", loop)
        loops["jaxckpt_hold"] = _jaxckpt_loop(
            cfg, tr, memory_root, work / f"solo-hold-{r}", loop, hold=True
        )
        loops["orbax"] = _orbax_loop(cfg, tr, work / f"solo-orbax-{r}", loop)
        loops["train_again"] = loop(tr, cfg["steps"])
        fixed = {
            "jaxckpt": _jaxckpt_fixed(cfg, memory_root, work / f"solo-tiny-{r}"),
            "orbax_trivial": _orbax_fixed(cfg, work / f"solo-trivial-{r}"),
        }
        rounds.append(
            {
                "loops": loops,
                "fixed_s": fixed,
                "spare": {"cpu_s": spare.cpu_s, "seconds": spare.seconds},
            }
        )
    return {"rounds": rounds, "tiny_bytes": TINY_BYTES, "warmup_saves": cfg["warmup"]}


def _floor_loop(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    loop: Callable[..., dict[str, list[float]]],
) -> dict[str, list[float]]:
    own = sum(s.nbytes for s in _state.own_shards(tr.state(0)))
    floor = _floor.Floor(memory_root, own, None, cfg["timeout_s"])
    try:
        return loop(tr, cfg["steps"], lambda s: floor.save(_state.own_shards(tr.state(s))))
    finally:
        floor.close()


def _jaxckpt_loop(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    directory: Path,
    loop: Callable[..., dict[str, list[float]]],
    hold: bool = False,
) -> dict[str, list[float]]:
    """A save every step as the training loops of 1a save (the defaults, nothing
    persisted), or as 1e's (`hold`: `TierOptions.hold_cpu_arrays`)."""
    ours = Jaxckpt.every_step(directory, memory_root, cfg, hold)
    try:
        record = loop(tr, cfg["steps"], lambda s: ours.save(s, tr.state(s)))
        ours.mngr.wait_until_finished()
        return record
    finally:
        _close(ours, directory)


def _orbax_loop(
    cfg: dict[str, Any],
    tr: _state.Training,
    directory: Path,
    loop: Callable[..., dict[str, list[float]]],
) -> dict[str, list[float]]:
    omngr = orbax_manager(directory, cfg, max_to_keep=2)
    try:
        record = loop(
            tr, cfg["steps"], lambda s: omngr.save(s, args=ocp.args.StandardSave(tr.state(s)))
        )
        omngr.wait_until_finished()
        return record
    finally:
        omngr.close()
        shutil.rmtree(directory, ignore_errors=True)


def _back_to_back(save: Callable[[int], None], wait: Callable[[], None]) -> list[float]:
    """Seconds each of `_TINY_SAVES` back-to-back `save(step)` calls took."""
    out = []
    for step in range(1, _TINY_SAVES + 1):
        start = time.perf_counter()
        save(step)
        out.append(time.perf_counter() - start)
    wait()
    return out


def _jaxckpt_fixed(cfg: dict[str, Any], memory_root: Path, directory: Path) -> list[float]:
    """jaxckpt's saves of a 1 MiB state (one array and the step), back to back."""
    state = {"w": jnp.ones((TINY_BYTES // 4,), jnp.float32), "step": 0}
    ours = Jaxckpt.every_step(directory, memory_root, cfg)
    try:
        return _back_to_back(lambda s: ours.save(s, state), ours.mngr.wait_until_finished)
    finally:
        _close(ours, directory)


def _orbax_fixed(cfg: dict[str, Any], directory: Path) -> list[float]:
    """Orbax's CheckpointManager saving a trivial item (a one-key JSON), back to back."""
    mngr = ocp.CheckpointManager(
        directory,
        item_handlers=ocp.JsonCheckpointHandler(),
        options=manager_options(directory, cfg, max_to_keep=2),
    )
    try:
        return _back_to_back(
            lambda s: mngr.save(s, args=ocp.args.JsonSave({"step": s})), mngr.wait_until_finished
        )
    finally:
        mngr.close()
        shutil.rmtree(directory, ignore_errors=True)


def _close(ours: Jaxckpt, directory: Path) -> None:
    run_dir = ours.memory_dir
    ours.close()
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
