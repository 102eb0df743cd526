"""Turns the processes' raw timings into figures (value, baseline, ratio).

Every ratio is value / baseline, both measured in the same run, and every figure reads
the processes' results as `_runs` does: across processes, the slowest one's. Phases 1-4's
figures come from `_local_figures`; this module adds those of the object store, the
many-leaf tree and the accelerator-host proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxckpt.bench import _runs, _spare
from jaxckpt.bench._figure import Figure
from jaxckpt.bench._local_figures import local_figures
from jaxckpt.launch import _throttle


def figures(procs: Sequence[dict[str, Any]], warmup: int, replicas: int) -> list[Figure]:
    """Every figure of the benchmark from the processes' raw results (those of the
    phases that ran: the object-store figures only with a store)."""
    out = local_figures(procs, warmup, replicas) if "loops" in procs[0] else []
    if "object_store" in procs[0]:
        out += _store_figures(procs)
    if "many_leaves" in procs[0]:
        out += _many_leaf_figures(procs)
    return out


def _store_figures(procs: Sequence[dict[str, Any]]) -> list[Figure]:
    """Persisting to an object store against tensorstore writing the same bytes there."""

    def median(key: str, kind: str = "saves") -> Callable[[dict[str, Any]], float | None]:
        """A process's median of `key` over its measured (not warm-up) repeats."""
        return lambda p: _runs.median([r[key] for r in p["object_store"][kind] if not r["warmup"]])

    def store_bw(key: str, kind: str = "saves") -> float | None:
        return _runs.scaled(_runs.worst(procs, median(key, kind), low=True), _runs.MB)

    def store_t(key: str) -> float | None:
        return _runs.worst(procs, median(key), low=False)

    baseline = store_bw("bytes_per_s", "baseline")
    name = "tensorstore zarr3 write, same chunks, same store"
    return [
        Figure(
            "7a",
            "object store: save until persisted",
            store_bw("bytes_per_s"),
            "MB/s",
            baseline,
            name,
            ">= 0.7",
        ),
        Figure(
            "7b",
            "object store: upload (handler persist_s)",
            store_bw("persist_bytes_per_s"),
            "MB/s",
            baseline,
            name,
        ),
        Figure(
            "7c",
            "object store: time outside the upload",
            store_t("outside_upload_s"),
            "s",
            store_t("seconds"),
            "the whole save until persisted",
        ),
    ]


def proxy_figures(proxy: dict[str, Any], warmup: int) -> list[Figure]:
    """The accelerator-host proxy: one process, its train step confined to one CPU and
    its saves to the others (`_proxy`); every loop against the same loop without saving.

    9a holds the saved arrays (`hold_cpu_arrays`), the CPU's counterpart of what a save
    on an accelerator does (its stall is the transfer to pinned host memory, the slab
    filled in the background); 9f is the CPU default, which copies into the slab
    inside `save()`, on the host's CPUs, while the device waits."""
    loops = proxy["loops"]

    def median(name: str, key: str = "step_s") -> float | None:
        return _runs.median(loops.get(name, {}).get(key, [])[warmup:])

    train = _runs.median(
        loops["train"]["step_s"][warmup:] + loops["train_again"]["step_s"][warmup:]
    )
    dispatch = _runs.median(
        loops["train"]["dispatch_s"][warmup:] + loops["train_again"]["dispatch_s"][warmup:]
    )
    base = "step time without saving (step on one CPU)"
    return [
        Figure(
            "9a",
            "proxy: step time, jaxckpt save every step (holding the arrays)",
            median("jaxckpt_hold"),
            "s",
            train,
            base,
            "<= 1.03",
        ),
        Figure("9b", "proxy: step time, the overlapped floor", median("floor"), "s", train, base),
        Figure(
            "9c", "proxy: step time, Orbax async save every step", median("orbax"), "s", train, base
        ),
        Figure(
            "9d",
            "proxy: mngr.save() blocks, jaxckpt (holding the arrays)",
            median("jaxckpt_hold", "save_s"),
            "s",
            train,
            "the same step time (the share of it)",
        ),
        Figure(
            "9e",
            "proxy: the step's dispatch while jaxckpt saves (holding)",
            median("jaxckpt_hold", "dispatch_s"),
            "s",
            dispatch,
            "the step's dispatch without saving (GIL waits)",
        ),
        Figure(
            "9f",
            "proxy: step time, jaxckpt save every step (copying in save())",
            median("jaxckpt"),
            "s",
            train,
            base,
        ),
    ]


def _many_leaf_figures(procs: Sequence[dict[str, Any]]) -> list[Figure]:
    """The many-leaf tree: jaxckpt's save until safe in memory and restore from memory,
    against Orbax saving it until finished and restoring it from its directory."""

    def saves(key: str, kind: str) -> float | None:
        return _runs.worst(
            procs,
            lambda p: _runs.median([s.get(key) for s in p["many_leaves"][kind] if not s["warmup"]]),
            low=False,
        )

    def restore(source: str) -> float | None:
        return _runs.worst(
            procs,
            lambda p: _runs.median([r["seconds"] for r in p["many_leaves"]["restores"][source]]),
            low=False,
        )

    n = procs[0]["many_leaves"]["leaves"]
    kib = procs[0]["many_leaves"]["leaf_bytes"] / 1024
    return [
        Figure(
            "8a",
            f"{n}-leaf tree ({kib:g} KiB each): save until safe in memory",
            saves("to_memory_s", "saves"),
            "s",
            saves("done_s", "orbax_saves"),
            "Orbax save of the same tree until finished",
            "<= 0.25",
        ),
        Figure(
            "8b",
            f"{n}-leaf tree ({kib:g} KiB each): restore from own memory",
            restore("memory"),
            "s",
            restore("orbax"),
            "Orbax restore of the same tree (cold)",
            "<= 0.2",
        ),
    ]


def solo_figures(solo: dict[str, Any], warmup: int) -> list[Figure]:
    """One process saving every step (`_solo`): each loop's median step over every round,
    against the loop without saving (10a's and 10e's target: the floor 10b's ratio +
    0.05; 10e holds the arrays, `hold_cpu_arrays`); the
    fixed cost of one save of a 1 MiB state against Orbax's manager saving a trivial item
    (10d's target: that cost + 2 ms); the loop beside a stand-in hot spare that compiles
    without pause at the launcher's waiting priority and CPU cap, against the same loop
    with it stopped, in alternating blocks of steps (10f, `_spare`: at most 2 % slower)."""
    rounds = solo["rounds"]

    def step(*names: str) -> float | None:
        return _runs.median(
            [
                s
                for r in rounds
                for n in names
                if n in r["loops"]  # a report from before the loop was measured lacks it
                for s in r["loops"][n]["step_s"][warmup:]
            ]
        )

    def fixed(name: str) -> float | None:
        skip = solo.get("warmup_saves", warmup)
        return _runs.median([t for r in rounds for t in r["fixed_s"][name][skip:]])

    base = "step time without saving (the same process, every round)"
    train = step("train", "train_again")
    floor = Figure(
        "10b", "1 process: step time, the overlapped floor", step("floor"), "s", train, base
    )
    bound = f"<= {floor.ratio + 0.05:.3f}" if floor.ratio is not None else None
    trivial = fixed("orbax_trivial")
    mib = solo["tiny_bytes"] / 2**20
    return [
        Figure(
            "10a",
            "1 process: step time, jaxckpt save every step",
            step("jaxckpt"),
            "s",
            train,
            base,
            bound,
        ),
        floor,
        Figure(
            "10e",
            "1 process: step time, jaxckpt save every step, holding the arrays",
            step("jaxckpt_hold"),
            "s",
            train,
            base,
            bound,
        ),
        Figure(
            "10c",
            "1 process: step time, Orbax async save every step",
            step("orbax"),
            "s",
            train,
            base,
        ),
        Figure(
            "10d",
            f"fixed cost of a save: jaxckpt, {mib:g} MiB state, back to back",
            fixed("jaxckpt"),
            "s",
            trivial,
            "Orbax's CheckpointManager saving a trivial item (a one-key JSON)",
            f"<= {(trivial + 0.002) / trivial:.3f}" if trivial else None,
        ),
        _spare_figure(step("beside_spare"), step("spare_stopped")),
    ]


def _spare_figure(capped: float | None, stopped: float | None) -> Figure:
    """10f: the loop's blocks beside the stand-in spare, capped, against those with it
    stopped (`_spare`)."""
    return Figure(
        "10f",
        "1 process: step time beside a hot spare compiling (nice 19, idle class,"
        f" --standby-cpu {_throttle.DEFAULT_SHARE})",
        capped,
        "s",
        stopped,
        f"the same loop in alternate blocks of {_spare.BLOCK_STEPS} steps, the spare stopped",
        "<= 1.02",
    )
