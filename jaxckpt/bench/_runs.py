"""The processes' raw results, read as every figure reads them.

In a process, a figure takes the median over its measured repeats (warm-up left out);
across processes, the slowest process's: the longest time or the lowest bandwidth, as a
job goes at the pace of its slowest host.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Final

from jaxckpt.bench._figure import Figure

MB: Final = 1e6


def median(xs: Sequence[float | None]) -> float | None:
    """The median of the values that were measured (None where none was)."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def worst(
    procs: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], float | None], *, low: bool
) -> float | None:
    """The slowest process's value: the lowest bandwidth (`low`) or the longest time."""
    vals = [v for p in procs if (v := get(p)) is not None]
    if not vals:
        return None
    return min(vals) if low else max(vals)


def total(*xs: float | None) -> float | None:
    """The sum, or None where any term is None."""
    return None if any(x is None for x in xs) else sum(x for x in xs if x is not None)


def scaled(x: float | None, by: float) -> float | None:
    """`x` in units of `by` (None stays None)."""
    return None if x is None else x / by


@dataclasses.dataclass(frozen=True)
class Runs:
    """The processes' raw results of phases 1-4, read as every figure reads them: in a
    process, the median over its measured repeats (warm-up left out); across processes,
    the slowest one's."""

    procs: Sequence[dict[str, Any]]
    warmup: int
    replicas: int

    def slowest(self, get: Callable[[dict[str, Any]], float | None]) -> float | None:
        """The longest time `get` reads from a process."""
        return worst(self.procs, get, low=False)

    def loop(self, name: str, key: str = "step_s") -> float | None:
        """The training loop `name`'s time per step (or its `key`)."""
        return self.slowest(lambda p: median(p["loops"].get(name, {}).get(key, [])[self.warmup :]))

    def saves(self, key: str, kind: str = "saves") -> float | None:
        """The isolated saves' `key` (jaxckpt's, or `kind` "orbax_saves")."""
        return self.slowest(lambda p: saves_median(p, key, kind))

    def raw(self, key: str) -> float | None:
        """The raw operation `key`'s time."""
        return self.slowest(lambda p: median(p["raw"][key]))

    def restore(self, source: str) -> float | None:
        """The restore from `source`'s time."""
        return self.slowest(lambda p: p["restores"].get(source, {}).get("seconds"))

    def train_step(self, p: dict[str, Any]) -> float | None:
        """A process's step time without saving: the no-save loop ran first and last, and
        its steps from both runs make the baseline."""
        loops = p["loops"]
        return median(
            loops["train"]["step_s"][self.warmup :] + loops["train_again"]["step_s"][self.warmup :]
        )

    def save_work(self, p: dict[str, Any]) -> float | None:
        """The raw work of a save every step here, done alone: copy the own bytes into
        pre-faulted tmpfs and checksum them; with replicas, also send and receive
        them over loopback and checksum what was received (old runs: no checksum)."""
        crc = median(p["raw"].get("checksum", [])) or 0.0
        work = total(median(p["raw"]["prefaulted_copy"]), crc)
        if self.replicas:
            work = total(work, median(p["raw"]["socket"]), crc * self.replicas)
        return work

    def bandwidth(
        self,
        id_: str,
        name: str,
        get: Callable[[dict[str, Any]], float | None],
        raw_key: str,
        baseline_name: str,
        target: str | None = None,
    ) -> Figure:
        """Bytes/s from `get` against the raw operation `raw_key` on the own bytes, in MB/s."""
        value = worst(self.procs, get, low=True)
        baseline = worst(self.procs, lambda p: _own_bytes_per_s(p, raw_key), low=True)
        return Figure(
            id_, name, scaled(value, MB), "MB/s", scaled(baseline, MB), baseline_name, target
        )


def saves_median(p: dict[str, Any], key: str, kind: str = "saves") -> float | None:
    """A process's median of `key` over its measured saves (jaxckpt's, or `kind`'s)."""
    return median([s.get(key) for s in p[kind] if not s["warmup"]])


def _own_bytes_per_s(p: dict[str, Any], raw_key: str) -> float | None:
    seconds = median(p["raw"][raw_key])
    return p["own_bytes"] / seconds if seconds else None
