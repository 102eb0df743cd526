"""The event lines of a launched job: what its processes print, what the launcher reads.

Every process of a job that ``python -m jaxckpt.launch`` runs may print, among its other
output, JSON objects on lines of their own, each with an ``event`` key naming its kind
(the examples print one per line, flushed)::

    {"event": "start", "process": p, "num_processes": n, "devices": d, "mesh": {...},
     "compilation_cache": "<dir>" | null}
    {"event": "restored", "step": s, "seconds": t, "process": p,
     "tier": "memory" | "peer" | "persistent" | ... | "unknown",
     "bytes_by_tier": {...}}  # bytes_by_tier only when the handler reports it
    {"event": "restore_failed", "step": s, "error": "...", "process": p}
    {"event": "step", "step": s, "loss": l, "data": "<uint32 hex checksum of the global batch>",
     "process": p, "seconds": t}  # seconds: since the previous step ended, its save included
    {"event": "save", "step": s, "seconds": t, "process": p}
    {"event": "done", "step": s, "seconds": t, "process": p}
    {"event": "stopped", "step": s, "process": p}  # asked to stop (SIGTERM): saved s, exits 0
    {"event": "replicas_lowered", "asked": r, "used": u, "process": p}  # fewer processes
    {"event": "standby", "process": p}  # a hot spare, ready, waiting for its go line
    {"event": "restore_prepared", "step": s, "leaves": k, "process": p}  # woken spare
    {"event": "timeline", "process": p, "phases": {name: [start, end], ...},
     "compile": {"cache_hits": h, "cache_misses": m, ..., "executable": "ahead" | "jit"},
     "restore": {"seconds": t, "tier": "...", "fallbacks": f}}
    {"event": "compiled_ahead_unusable", "error": "...", "process": p}
    {"event": "executable_unusable", "path": "...", "error": "...", "process": p}

The launcher reads four of them: ``step`` (progress, the first trained step of an
attempt, the last step before a failure), ``restored`` (the step, tier and seconds of
each process's restore), ``timeline`` (the recovery timeline, `_timeline`) and
``stopped`` (the job stopped when the launcher asked it to, to grow back: `_launcher`);
the others are for people and for the demo. ``timeline`` follows the first trained step of a run:
the wall-clock (``time.time()``) start and end of each phase of the process's start, the
usual ones in `PHASES`, in order: ``startup`` (process creation to ``main``: interpreter
and imports), ``jax_init`` (``jax.distributed`` and the backend), ``task``, ``setup``
(mesh, abstract state, data), ``compile`` (the train step, which may overlap
``restore``), ``warm_up`` and ``standby`` (a hot spare running its train step once on a
fresh state, then waiting for its go line), ``manager``, ``restore`` or ``init``, and
``first_step`` (a woken spare adds ``prepare_restore``: the last time it compiled its
restore ahead, before the failure). Its ``compile`` counts the compilation caches' hits and misses of the
train step and of the whole process; its ``restore`` is the handler's own restore time.

The names and fields are a compatibility promise between a job and the launcher: fields
may be added, never renamed or removed. Readers (`parse_event`) take any command's
output, so they keep events and fields they do not know and tolerate missing ones.
Writers build the frozen dataclasses below and print `format_event` of them. Imports
neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Final

PHASES: Final = (
    "startup",
    "jax_init",
    "task",
    "setup",
    "compile",
    "warm_up",
    "standby",
    "manager",
    "restore",
    "init",
    "first_step",
)


@dataclasses.dataclass(frozen=True)
class Event:
    """An event line; ``kind`` is its ``event`` key, the fields follow in order.

    A field whose default is None is left out of the line while it is None.
    """

    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The event as the JSON object of its line, ``event`` first."""
        out: dict[str, Any] = {"event": self.kind}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None or field.default is not None:
                out[field.name] = value
        return out


@dataclasses.dataclass(frozen=True)
class StartEvent(Event):
    """The process joined its job and built its mesh."""

    kind: ClassVar[str] = "start"
    process: int
    num_processes: int
    devices: int
    mesh: dict[str, int]
    compilation_cache: str | None


@dataclasses.dataclass(frozen=True)
class RestoredEvent(Event):
    """The process restored ``step``; ``tier`` is where the bytes came from."""

    kind: ClassVar[str] = "restored"
    step: int
    seconds: float
    process: int
    tier: str
    bytes_by_tier: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class RestoreFailedEvent(Event):
    """The restore of ``step`` raised ``error``."""

    kind: ClassVar[str] = "restore_failed"
    step: int
    error: str
    process: int


@dataclasses.dataclass(frozen=True)
class StepEvent(Event):
    """A trained step; ``data`` is the hex checksum of its global batch."""

    kind: ClassVar[str] = "step"
    step: int
    loss: float
    data: str
    process: int
    seconds: float | None = None  # since the previous step ended (its save included)


@dataclasses.dataclass(frozen=True)
class SaveEvent(Event):
    """The save of ``step`` was issued; ``seconds`` is how long it held training up."""

    kind: ClassVar[str] = "save"
    step: int
    seconds: float
    process: int


@dataclasses.dataclass(frozen=True)
class DoneEvent(Event):
    """The process trained its last step and is about to exit 0."""

    kind: ClassVar[str] = "done"
    step: int
    seconds: float
    process: int


@dataclasses.dataclass(frozen=True)
class StoppedEvent(Event):
    """The process stopped when asked (a preemption notice, SIGTERM, reached at the same
    step on every process): step ``step`` is saved and committed; it exits 0."""

    kind: ClassVar[str] = "stopped"
    step: int
    process: int


@dataclasses.dataclass(frozen=True)
class ReplicasLoweredEvent(Event):
    """Fewer peer copies than asked for: the job has too few processes."""

    kind: ClassVar[str] = "replicas_lowered"
    asked: int
    used: int
    process: int


@dataclasses.dataclass(frozen=True)
class StandbyEvent(Event):
    """A hot spare is ready and waits for its go line on stdin."""

    kind: ClassVar[str] = "standby"
    process: int


@dataclasses.dataclass(frozen=True)
class RestorePreparedEvent(Event):
    """A woken spare had compiled ahead the restore of step ``step`` onto its target
    (``TieredCheckpointHandler.prepare_restore``): a reshard of ``leaves`` leaves (0: the
    restore compiles nothing)."""

    kind: ClassVar[str] = "restore_prepared"
    step: int
    leaves: int
    process: int


@dataclasses.dataclass(frozen=True)
class TimelineEvent(Event):
    """The phases of the process's start, after its first trained step (see above)."""

    kind: ClassVar[str] = "timeline"
    process: int
    phases: dict[str, list[float]]
    compile: dict[str, Any]
    restore: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CompiledAheadUnusableEvent(Event):
    """The train step compiled ahead did not take the real state; the jitted one ran."""

    kind: ClassVar[str] = "compiled_ahead_unusable"
    error: str
    process: int


@dataclasses.dataclass(frozen=True)
class ExecutableUnusableEvent(Event):
    """A cached executable at ``path`` could not be loaded; the process compiled it."""

    kind: ClassVar[str] = "executable_unusable"
    path: str
    error: str
    process: int


def format_event(event: Event) -> str:
    """The line that carries ``event`` (JSON, no newline)."""
    return json.dumps(event.to_dict())


def parse_event(line: str) -> dict[str, Any] | None:
    """Returns the JSON event of an output line, or None if it is not one.

    Any object with an ``event`` key is an event, of a kind above or not, with whatever
    fields it has: the launcher runs any command.
    """
    try:
        event = json.loads(line) if line.lstrip().startswith("{") else None
    except ValueError:
        return None
    return event if isinstance(event, dict) and "event" in event else None
