"""Key-value stores an exchange runs through: jax's coordinator, or a group's relay.

`KeyValueClient` is the part of jax's `DistributedRuntimeClient` an exchange
uses (`_multihost`). `RelayStore` is the same semantics in one process's
memory: the store a group's relay leader keeps, which its members reach over
the peer data service (`jaxckpt.peer`) and the leader itself calls directly
(`_relay`). Its semantics are the coordinator's: `key_value_set` refuses to
overwrite unless asked, `blocking_key_value_get` waits for a key or fails
with DEADLINE_EXCEEDED, `key_value_dir_get(k)` returns every key under
`k/`, and `key_value_delete(k)` removes `k` and everything under `k/`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

DEADLINE_EXCEEDED: Final = "DEADLINE_EXCEEDED"  # in a blocking get's error when it timed out
ALREADY_EXISTS: Final = "ALREADY_EXISTS"  # in a set's error when it would overwrite


class KeyValueClient(Protocol):
    """The part of jax's `DistributedRuntimeClient` an exchange uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
    def key_value_delete(self, key: str) -> None: ...


class RelayStore:
    """A key-value store in this process's memory, with the coordinator's semantics
    (see the module docstring); thread-safe. Errors are RuntimeErrors whose text
    says `ALREADY_EXISTS` or `DEADLINE_EXCEEDED`, as the coordinator's do."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._changed:
            if key in self._data and not allow_overwrite:
                raise RuntimeError(f"{ALREADY_EXISTS}: key {key} already exists.")
            self._data[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        deadline = time.monotonic() + max(0, timeout_in_ms) / 1000
        with self._changed:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"{DEADLINE_EXCEEDED}: GetKeyValue() timed out with key: {key}"
                    )
                self._changed.wait(left)
            return self._data[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        below = key.rstrip("/") + "/"
        with self._changed:
            return sorted((k, v) for k, v in self._data.items() if k.startswith(below))

    def key_value_delete(self, key: str) -> None:
        below = key.rstrip("/") + "/"
        with self._changed:
            for k in [k for k in self._data if k == key or k.startswith(below)]:
                del self._data[k]

    def __len__(self) -> int:
        with self._changed:
            return len(self._data)


def get(
    client: KeyValueClient, key: str, deadline: float, clock: Callable[[], float]
) -> str | None:
    """The value of `key` once it is set, or None if `deadline` (on `clock`) passes first."""
    ms = max(1, int((deadline - clock()) * 1000))
    try:
        return client.blocking_key_value_get(key, ms)
    except Exception as e:  # the runtime raises its own error types
        if DEADLINE_EXCEEDED in str(e) or "timed out" in str(e):
            return None
        raise
