"""Values kept in the jax.distributed coordinator's store for a run, outside any exchange.

An exchange (`_multihost`) deletes its keys once every process is done with
it. A few values are read later by only some processes, and only when they
need them: a process's peer address, which the set-up tells only the owners
whose copies it holds (`peer._peers`), is looked up by any other process that
comes to read from it. Each is one key, written once by its process (`publish`), read by
those few (`look_up`), and deleted when its process is done (`unpublish`): the
store holds O(N) of them for a run, never more.
"""

from __future__ import annotations

from typing import Final

from absl import logging as log

from jaxckpt.coord import _multihost

PUBLISHED: Final = "jaxckpt-published"  # values kept for a run, outside every exchange


def publish(name: str, value: str) -> None:
    """Keeps `value` under `name` in the coordinator's store until `unpublish`, for any
    process to `look_up` (a process's peer address: read by the few that need it).
    Nothing in one process (there is no other to look it up)."""
    if _multihost.process_count() == 1:
        return
    _multihost.session()[0].key_value_set(f"{PUBLISHED}/{name}", value, allow_overwrite=True)


def look_up(name: str, timeout_s: float) -> str:
    """The value published under `name`, waiting for it at most `timeout_s`.

    Raises:
      TimeoutError: if nothing is published under `name` in time.
      ConnectionError: if the coordination service failed.
    """
    client, me, _, clock = _multihost.session()
    try:
        value = _multihost.wait_for(client, f"{PUBLISHED}/{name}", clock() + timeout_s, clock)
    except Exception as e:
        raise ConnectionError(
            f"[process {me}] Looking up {name!r} through the jax.distributed coordination "
            f"service failed: {e}. Is the coordinator (process 0) still running?"
        ) from e
    if value is None:
        raise TimeoutError(
            f"[process {me}] Nothing was published under {name!r} within {timeout_s:g} s "
            "(the process that publishes it did not start, or left the job)."
        )
    return value


def unpublish(name: str) -> None:
    """Deletes what `publish` kept under `name` (cleanup: a failure is only logged)."""
    if _multihost.process_count() == 1:
        return
    try:
        _multihost.session()[0].key_value_delete(f"{PUBLISHED}/{name}")
    except Exception as e:
        log.warning("jaxckpt: could not delete %s from the coordinator's store: %s", name, e)
