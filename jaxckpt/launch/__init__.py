"""The local launcher: N processes as one `jax.distributed` job, with failure injection.

`python -m jaxckpt.launch -n 4 --kill 2@7 -- python examples/lm.py ...` (see `_launcher`).
The event lines a launched job prints (`step`, `restored`, `timeline`, ...) are defined in
`_events`: a job writes them with the event classes and `format_event`, the launcher and
the demo read them with `parse_event`.
"""

from jaxckpt.launch._events import PHASES as PHASES
from jaxckpt.launch._events import CompiledAheadUnusableEvent as CompiledAheadUnusableEvent
from jaxckpt.launch._events import DoneEvent as DoneEvent
from jaxckpt.launch._events import Event as Event
from jaxckpt.launch._events import ExecutableUnusableEvent as ExecutableUnusableEvent
from jaxckpt.launch._events import ReplicasLoweredEvent as ReplicasLoweredEvent
from jaxckpt.launch._events import RestoredEvent as RestoredEvent
from jaxckpt.launch._events import RestoreFailedEvent as RestoreFailedEvent
from jaxckpt.launch._events import RestorePreparedEvent as RestorePreparedEvent
from jaxckpt.launch._events import SaveEvent as SaveEvent
from jaxckpt.launch._events import StandbyEvent as StandbyEvent
from jaxckpt.launch._events import StartEvent as StartEvent
from jaxckpt.launch._events import StepEvent as StepEvent
from jaxckpt.launch._events import StoppedEvent as StoppedEvent
from jaxckpt.launch._events import TimelineEvent as TimelineEvent
from jaxckpt.launch._events import format_event as format_event
from jaxckpt.launch._events import parse_event as parse_event
from jaxckpt.launch._launcher import main as main

__all__ = [
    "PHASES",
    "CompiledAheadUnusableEvent",
    "DoneEvent",
    "Event",
    "ExecutableUnusableEvent",
    "ReplicasLoweredEvent",
    "RestoreFailedEvent",
    "RestorePreparedEvent",
    "RestoredEvent",
    "SaveEvent",
    "StandbyEvent",
    "StartEvent",
    "StepEvent",
    "StoppedEvent",
    "TimelineEvent",
    "format_event",
    "main",
    "parse_event",
]
