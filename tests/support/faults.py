"""The tests' faults, installed at jaxckpt's fault points (`jaxckpt._faults`).

- `JAXCKPT_FAULT`, for child processes: `<point>@<step>[@<process>]` kills the process
  with SIGKILL when it reaches that point of that step, so that a test crashes a save at
  an exact point instead of relying on timing luck; `fail:<point>@<step>[@<process>]`
  (`<step>` may be `*`) fails it there with a `RuntimeError`, as if its own work had
  failed just before (before an exchange of a collective operation, every process must
  then raise it). A child process reads it once it called `install_from_env()` (the
  workers' scaffolding and the crash scripts do), at each point, so it may change it.
- `at`, `held`, `failing`: a hook for one test's block, in this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Final

from jaxckpt import _faults

ENV: Final = "JAXCKPT_FAULT"
FAIL: Final = "fail:"  # the prefix of a point where the process fails instead
_INSTALLED: list[Callable[[], None]] = []


def _wanted(spec: str, name: str, step: int | None, process: int) -> bool:
    want, want_step, *rest = spec.split("@")
    return (
        want == name
        and (want_step == "*" or (step is not None and int(want_step) == step))
        and (not rest or int(rest[0]) == process)
    )


def from_env(point: str, step: int | None, process: int) -> None:
    """The hook behind `JAXCKPT_FAULT` (see the module docstring)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    if _wanted(spec, point, step, process):
        os.kill(os.getpid(), signal.SIGKILL)
    if _wanted(spec, FAIL + point, step, process):
        raise injected(point, step, process)


def injected(point: str, step: int | None, process: int) -> RuntimeError:
    """The failure a `fail:` fault raises (and a test expects)."""
    return RuntimeError(f"[process {process}] injected fault before {point} of step {step} ({ENV})")


def install_from_env() -> None:
    """Makes this process obey `JAXCKPT_FAULT` for the rest of its life (once)."""
    if not _INSTALLED:
        _INSTALLED.append(_faults.install(from_env))


@contextlib.contextmanager
def at(point: str, action: Callable[[int | None, int], None]) -> Iterator[None]:
    """Runs `action(step, process)` at every `point` while the block runs."""
    if point not in _faults.POINTS:
        raise ValueError(f"Unknown fault point {point!r}: one of {', '.join(_faults.POINTS)}.")

    def hook(reached: str, step: int | None, process: int) -> None:
        if reached == point:
            action(step, process)

    with _faults.hooked(hook):
        yield


@contextlib.contextmanager
def held(
    point: str, steps: Collection[int] | None = None, timeout_s: float = 60
) -> Iterator[threading.Event]:
    """Holds `point` of `steps` (of every step if None) until the test sets the event
    this yields (set on leaving the block); a hold past `timeout_s` fails that work."""
    gate = threading.Event()

    def hold(step: int | None, process: int) -> None:
        if (steps is None or step in steps) and not gate.wait(timeout_s):
            raise TimeoutError(f"the test never released {point} of step {step}")

    try:
        with at(point, hold):
            yield gate
    finally:
        gate.set()


@contextlib.contextmanager
def failing(point: str, error: BaseException | None = None) -> Iterator[None]:
    """Fails this process at every `point` while the block runs: with `error`, else with
    the failure `JAXCKPT_FAULT=fail:<point>...` would raise (`injected`)."""

    def fail(step: int | None, process: int) -> None:
        raise error if error is not None else injected(point, step, process)

    with at(point, fail):
        yield
