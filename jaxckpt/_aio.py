"""Running a coroutine to completion from synchronous code, with or without a running loop.

`asyncio.run` refuses to start inside a thread that already runs an event loop,
which is where a Jupyter cell runs (and any `async def` caller of
`mngr.save()`/`mngr.restore()`). There the coroutine runs on a fresh loop in a
short-lived thread instead, and the caller's thread blocks until it is done, as
a synchronous call does anyway.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """The result of `coro`, run to completion on a loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-sync") as pool:
        return pool.submit(asyncio.run, coro).result()
