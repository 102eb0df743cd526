"""Hosts that come back, or new ones: a directory where each registers its node.

A host that returns after a loss, or a new one, registers with the launcher by creating
a file named after its node (its failure domain), ``node<k>``, in the registration
directory (``--register-dir``; default ``<memory-base>/register``). On a cluster that is
a directory every host and the launcher see (a shared filesystem); a host writes it when
it is up (``touch <dir>/node7``). The launcher takes each registration once: it reads the
directory at most every `POLL_S` and removes the files it takes. ``--return-node P@S``
registers node P the same way once the job reached step S, so that a test or the demo
goes through the path a real host uses. Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Final

POLL_S: Final = 0.5
NODE_FILE: Final = re.compile(r"^node(\d+)$")


def register(directory: str, node: int) -> str:
    """Registers `node` in `directory` (what a host does when it is up); returns the file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"node{node}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{time.time()}\n")
    os.replace(tmp, path)  # atomic: the launcher sees the whole file or none
    return path


class Registry:
    """The registrations of one launch, each taken once."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._next_poll = 0.0

    def take(self) -> list[int]:
        """The nodes registered since the last call, in order (at most one read of the
        directory every `POLL_S`; names other than ``node<k>`` are left alone)."""
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + POLL_S
        nodes = []
        for name in sorted(os.listdir(self.directory)):
            m = NODE_FILE.match(name)
            if m is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.directory, name))
                nodes.append(int(m[1]))
        return sorted(nodes)
