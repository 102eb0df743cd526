"""The one place that talks to other processes; every call degrades to one process."""

from __future__ import annotations

import jax


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()
