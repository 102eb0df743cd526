"""A save's measurements as a typed record, and where every measurement goes.

`SaveMetrics` is filled by the save that owns it (`_save.Save`), one phase after
another; `Publisher` hands a save's, persist's or restore's measurements (or a
failure) to the log, the user's `on_metrics` callback and the handler's
`last_*_metrics`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from absl import logging as log

from jaxckpt.coord import _multihost


@dataclasses.dataclass
class SaveMetrics:
    """One save of one process, phase by phase (seconds from `async_save`'s start for
    the `safe_*` fields). Fields left None were not measured (a phase that did not run)."""

    step: int
    process: int
    bytes: int
    stall_s: float
    host_staging: str  # slab, copy, cpu_view, pinned_host or pageable
    slab_copy_s: float | None = None  # the copy into the slab before `async_save` returned
    memory_write_s: float | None = None
    memory_write_bytes_per_s: float | None = None
    safe_in_memory_s: float | None = None
    replicate_s: float | None = None
    replicate_bytes: int | None = None
    replicate_bytes_per_s: float | None = None
    safe_on_peers_s: float | None = None
    agree_s: float | None = None
    nonfinite: int | None = None  # NaN/Inf values in this part (None: not counted)

    def to_dict(self) -> dict[str, Any]:
        """The `save` event as the log, the callback and the manifest carry it."""
        out: dict[str, Any] = {"event": "save"}
        # Every field is a scalar: no `dataclasses.asdict` (it deep-copies, 3 times a save).
        for name in _SAVE_FIELDS:
            if (value := getattr(self, name)) is not None:
                out[name] = value
        return out


_SAVE_FIELDS = tuple(f.name for f in dataclasses.fields(SaveMetrics))


class Publisher:
    """Hands measurements and failures to the log and the user's callback.

    Attributes:
      last: event ("save", "restore", "persist") -> its latest measurements.
    """

    def __init__(self, on_metrics: Callable[[dict[str, Any]], None] | None = None):
        self._on_metrics = on_metrics
        self.last: dict[str, dict[str, Any]] = {"save": {}, "restore": {}, "persist": {}}
        self._announced = False

    def publish(self, metrics: dict[str, Any]) -> None:
        """Logs `metrics` (a dict with an "event") and hands a copy to the callback.

        Quiet by default: a save's and a persist's measurements are logged at DEBUG
        (the first save says what is set up: `announce`), a restore as one INFO line
        naming the step, where it came from and how long it took; failures at INFO.
        """
        event = metrics["event"]
        if event in self.last:
            self.last[event] = metrics
        if event == "restore":
            log.info("jaxckpt: %s", restore_line(metrics))
            log.debug("jaxckpt: %s", metrics)
        elif event in ("save", "persist"):
            log.debug("jaxckpt: %s", metrics)
        else:
            log.info("jaxckpt: %s", metrics)
        if self._on_metrics is not None:
            # The user's callback is no part of checkpointing: its failure must not fail
            # a save or a restore, nor be taken for a failed persist.
            try:
                self._on_metrics(dict(metrics))
            except Exception:
                log.exception(
                    "jaxckpt: the on_metrics callback failed on the %s event of step %s; "
                    "checkpointing is not affected",
                    metrics.get("event"),
                    metrics.get("step"),
                )

    def announce(self, line: str) -> None:
        """Logs `line` at INFO, the first time only (the first save's set-up)."""
        if not self._announced:
            self._announced = True
            log.info("jaxckpt: %s", line)

    def failure(self, operation: str, step: int | None, error_text: str) -> None:
        """Publishes a failed save or restore (`<operation>_failed`); `error_text` is
        already redacted of secrets."""
        self.publish(
            {
                "event": f"{operation}_failed",
                "process": _multihost.process_index(),
                "step": step,
                "error": error_text,
            }
        )


def restore_line(metrics: dict[str, Any]) -> str:
    """One line for a `restore` event: the step, its sources by share of bytes, the time."""
    by_tier = metrics.get("bytes_by_tier") or {}
    total = sum(by_tier.values())
    sources = " + ".join(
        f"{tier} {n / total:.0%}" if len(by_tier) > 1 else tier
        for tier, n in sorted(by_tier.items(), key=lambda kv: -kv[1])
    )
    fallbacks = metrics.get("fallbacks") or 0
    return (
        f"[process {metrics.get('process')}] restored step {metrics.get('step')} from "
        f"{sources or 'no array bytes'} in {metrics.get('seconds', 0.0):.2f} s"
        + (f" ({fallbacks} chunk read(s) fell back to another copy)" if fallbacks else "")
    )


def restore_metrics(
    step: int, seconds: float, bytes_by_tier: dict[str, int], bytes_needed: int, fallbacks: int
) -> dict[str, Any]:
    """The `restore` event of a restore of `step` that took `seconds`: the bytes it read
    from each tier, the bytes of the target's regions it read (with `bytes_by_tier`, how
    much more a restore onto another mesh read than it needed: tiles, `_tiles`), and
    how many chunk reads fell back to another copy."""
    return {
        "event": "restore",
        "process": _multihost.process_index(),
        "step": step,
        "seconds": seconds,
        "bytes_by_tier": dict(bytes_by_tier),
        "bytes_needed": bytes_needed,
        "tier": max(bytes_by_tier, key=bytes_by_tier.__getitem__) if bytes_by_tier else "none",
        "fallbacks": fallbacks,
    }
