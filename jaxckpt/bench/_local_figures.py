"""The figures of phases 1-4 (1a-6d, every run but `--store-only`), a group per phase:
step time, stall, time to safe, bandwidths, restores and host memory, each against the
baseline measured for it in the same run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxckpt.bench._figure import Figure
from jaxckpt.bench._runs import Runs, median, saves_median, total


def local_figures(procs: Sequence[dict[str, Any]], warmup: int, replicas: int) -> list[Figure]:
    """The figures of phases 1-4 (every run but `--store-only`), a group per phase."""
    runs = Runs(procs, warmup, replicas)
    return [
        *_step_time_figures(runs),
        *_stall_figures(runs),
        *_time_to_safe_figures(runs),
        *_bandwidth_figures(runs),
        *_restore_figures(runs),
        *_memory_figures(runs),
    ]


def _persisted(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A process's median of `key` over the parts it persisted."""
    return lambda p: median([d.get(key) for d in p.get("persist") or []])


def _reused_slab_write(p: dict[str, Any]) -> float | None:
    """The memory tier's write bandwidth in the measured saves that reused a slab."""
    return median(
        [
            s.get("memory_write_bytes_per_s")
            for s in p["saves"]
            if not s["warmup"] and s.get("slab_reused")
        ]
    )


def _push_alone(p: dict[str, Any]) -> float | None:
    return median([d["bytes"] / d["seconds"] for d in p.get("push_alone") or []])


def _step_time_figures(runs: Runs) -> list[Figure]:
    """1a-1f: the step time with a save every step, against the step without saving."""
    vs_train = functools.partial(
        Figure,
        unit="s",
        baseline=runs.slowest(runs.train_step),
        baseline_name="step time without saving",
    )
    floor = vs_train(
        "1d", "step time, a save's raw work overlapped (the floor)", runs.loop("floor")
    )
    # 1a's target: within 0.05 of the floor measured in the same run (old runs: 1.15).
    bound = f"<= {floor.ratio + 0.05:.3f}" if floor.ratio is not None else "<= 1.15"
    not_overlapped = runs.slowest(lambda p: total(runs.train_step(p), runs.save_work(p)))
    return [
        vs_train("1a", "step time, jaxckpt save every step", runs.loop("jaxckpt"), target=bound),
        vs_train("1b", "step time, Orbax async save every step", runs.loop("orbax")),
        vs_train("1c", "no-save step + a save's raw work, not overlapped", not_overlapped),
        floor,
        vs_train(
            "1e",
            "step time, jaxckpt save every step, holding the arrays",
            runs.loop("jaxckpt_hold"),
            target=bound,
        ),
        Figure(
            "1f",
            "step time, jaxckpt save every step, NaN/Inf counted (the default)",
            runs.loop("jaxckpt"),
            "s",
            runs.loop("jaxckpt_uncounted"),
            "the same, count_nonfinite=False",
            "<= 1.03",
        ),
    ]


def _stall_figures(runs: Runs) -> list[Figure]:
    """2a-2d: how long a save blocks the training, against the raw device->host copy."""
    vs_copy = functools.partial(
        Figure,
        unit="s",
        baseline=runs.raw("d2h"),
        baseline_name="raw device->host copy of own shards",
    )
    return [
        vs_copy("2a", "stall: jaxckpt mngr.save() blocks (isolated)", runs.saves("save_wall_s")),
        vs_copy("2b", "stall: jaxckpt snapshot (handler stall_s)", runs.saves("stall_s")),
        vs_copy("2c", "stall: jaxckpt mngr.save() in the loop", runs.loop("jaxckpt", "save_s")),
        vs_copy(
            "2d",
            "stall: Orbax mngr.save() blocks (isolated)",
            runs.saves("save_wall_s", "orbax_saves"),
        ),
    ]


def _time_to_safe_figures(runs: Runs) -> list[Figure]:
    """3a-3c: how long until a save is safe, against the raw operations it is made of."""
    d2h, tmpfs = runs.raw("d2h"), runs.raw("tmpfs_write")
    to_memory = runs.saves("to_memory_s")
    return [
        Figure(
            "3a",
            "time to safe: committed in memory",
            to_memory,
            "s",
            total(d2h, tmpfs),
            "raw device->host copy + raw tmpfs write",
        ),
        Figure(
            "3b",
            "time to safe: replicated to a peer",
            runs.saves("to_replicated_s"),
            "s",
            total(d2h, tmpfs, runs.raw("socket")),
            "raw copy + tmpfs write + loopback send",
        ),
        Figure(
            "3c",
            "time to safe in memory vs Orbax durable",
            to_memory,
            "s",
            runs.saves("done_s", "orbax_saves"),
            "Orbax save until committed on disk",
        ),
    ]


def _bandwidth_figures(runs: Runs) -> list[Figure]:
    """4a-4e: the bandwidths within a save, against raw operations on the same bytes."""
    loopback = "raw loopback TCP, same pattern"
    return [
        runs.bandwidth(
            "4a",
            "memory-tier write bandwidth (slab reused)",
            _reused_slab_write,
            "prefaulted_copy",
            "memcpy into a pre-faulted tmpfs file",
            ">= 0.8",
        ),
        runs.bandwidth(
            "4b",
            "persistence bandwidth",
            _persisted("persist_bytes_per_s"),
            "fsync_write",
            "raw fsync'd file writes, same disk",
            ">= 0.7",
        ),
        runs.bandwidth(
            "4c",
            "peer (replica push) bandwidth within a save",
            lambda p: saves_median(p, "replicate_bytes_per_s"),
            "socket",
            loopback,
        ),
        Figure(
            "4d",
            "persistence: time in fsync (files, dirs)",
            runs.slowest(_persisted("fsync_s")),
            "s",
            runs.slowest(_persisted("persist_s")),
            "the whole persist of the part",
        ),
        runs.bandwidth(
            "4e",
            "peer push alone (every process at once)",
            _push_alone,
            "socket",
            loopback,
            ">= 0.5",
        ),
    ]


def _restore_figures(runs: Runs) -> list[Figure]:
    """5a-5e: a restore from each source, against Orbax's (5e: against its own floor)."""
    vs_orbax = functools.partial(
        Figure,
        unit="s",
        baseline=runs.restore("orbax"),
        baseline_name="Orbax restore (persistent, cold)",
    )
    return [
        vs_orbax("5a", "restore from own memory", runs.restore("memory"), target="<= 0.33"),
        vs_orbax("5b", "restore from peer memory", runs.restore("peer"), target="<= 0.33"),
        Figure(
            "5e",
            "restore from peer memory vs its floor",
            runs.restore("peer"),
            "s",
            total(runs.restore("memory"), runs.raw("socket")),
            "restore from own memory + raw loopback TCP of the own bytes",
        ),
        vs_orbax("5c", "restore from persistent (cold)", runs.restore("persistent")),
        Figure(
            "5d",
            "restore from memory onto another mesh",
            runs.restore("memory_mesh_change"),
            "s",
            runs.restore("orbax_mesh_change"),
            "Orbax restore onto the same mesh change",
        ),
    ]


def _memory_figures(runs: Runs) -> list[Figure]:
    """6a-6d: host memory in copies of the state, against the copies r replicas need."""
    procs, replicas = runs.procs, runs.replicas
    memory = [p["memory"] for p in procs]
    state = procs[0]["state_bytes"]
    rss_delta = sum(max(0, m["jaxckpt_rss_peak"] - m["train_rss_peak"]) for m in memory)
    tmpfs_steady = sum(m["tmpfs_steady"] for m in memory)
    tmpfs_spare = sum(m.get("tmpfs_spare", 0) for m in memory)
    combined = sum(m["jaxckpt_combined_peak"] for m in memory)
    held = [m.get("hold_jaxckpt_combined_peak") for m in memory]  # older runs: none
    combined_holding = sum(held) if all(h is not None for h in held) else None
    # The save loop's memory_keep: at a save's peak the tier holds one step more.
    keep = memory[0].get("memory_keep", 1)
    steady = functools.partial(
        Figure, unit="x state", baseline=1.0 + replicas, baseline_name="1 + r copies of the state"
    )
    peak = functools.partial(
        Figure,
        unit="x state",
        baseline=(keep + 1.0) * (1.0 + replicas),
        baseline_name="(memory_keep + 1)(1 + r) copies of the state",
    )
    return [
        steady(
            "6a",
            f"host memory (peak RSS delta + tmpfs), r={replicas}",
            (rss_delta + tmpfs_steady) / state,
            target="<= 1.1",
        ),
        peak(
            "6b",
            f"host memory, peak during saves (memory_keep={keep}), r={replicas}",
            combined / state,
            target="<= 1.05",
        ),
        steady(
            "6c",
            f"host memory as 6a, less the spare slabs (spare_slabs=False), r={replicas}",
            (rss_delta + tmpfs_steady - tmpfs_spare) / state,
        ),
        peak(
            "6d",
            f"host memory as 6b, holding the arrays (1e's loop), r={replicas}",
            None if combined_holding is None else combined_holding / state,
        ),
    ]
