"""The one place that talks to other processes; every call degrades to one process.

Small control messages (inventories, peer addresses, the run's token) go
through the jax.distributed key-value store, and every wait has a timeout: a
dead process turns into a `TimeoutError` that names what was awaited, never a
hang. Bulk bytes never go through here (see the peer data service).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jax
from jax._src import distributed

_PREFIX = "jaxckpt"
_rounds = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def _client() -> Any:
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jaxckpt needs jax.distributed.initialize() before it can exchange data between "
            f"{process_count()} processes."
        )
    return client


def allgather(value: Any, *, tag: str, timeout_s: float) -> list[Any]:
    """Every process's JSON-serializable `value`, in process order.

    All processes must call this in the same order with the same `tag`.

    Raises:
      TimeoutError: if some process did not contribute within `timeout_s`,
        naming the processes that were missing.
    """
    count = process_count()
    if count == 1:
        return [value]
    client = _client()
    key = f"{_PREFIX}/{tag}/{next(_rounds)}"
    client.key_value_set(f"{key}/{process_index()}", json.dumps(value))
    out, missing = [], []
    for p in range(count):
        try:
            out.append(
                json.loads(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
            )
        except Exception:  # the runtime raises its own error types
            missing.append(p)
    if missing:
        raise TimeoutError(
            f"[process {process_index()}] Processes {missing} did not answer the exchange "
            f"'{tag}' within {timeout_s:.0f} s (dead or stuck); raise TierOptions.timeout_s if "
            "they are just slow."
        )
    return out


def broadcast(value: Any, *, tag: str, timeout_s: float) -> Any:
    """Process 0's `value`, on every process."""
    if process_count() == 1:
        return value
    client = _client()
    key = f"{_PREFIX}/{tag}/{next(_rounds)}"
    if process_index() == 0:
        client.key_value_set(key, json.dumps(value))
    try:
        return json.loads(client.blocking_key_value_get(key, int(timeout_s * 1000)))
    except Exception as e:
        raise TimeoutError(
            f"[process {process_index()}] Process 0 did not publish '{tag}' within {timeout_s:.0f} s."
        ) from e
