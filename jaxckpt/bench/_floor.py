"""The floor of a save every step, overlapped with the training (figure 1d).

What any design that copies and checksums every byte must do, done the cheapest
way an asynchronous save can do it: after a train step, hold this process's own
shards (as a save that returns at once must: the next, donating step then writes
its outputs elsewhere) and, on one background thread while the next step runs,
copy them 1 MiB at a time into a pre-faulted tmpfs mapping, each MiB's CRC-32C
computed right after its copy, while it is in cache; with replicas, send the
mapping's bytes to the next process over loopback TCP while a second thread
receives the previous process's into another pre-faulted mapping, checksumming
each MiB as it lands. The next save waits for the previous one's work first, as
a checkpoint manager does. No manifest, no commit, no protocol: a bound, not a
design.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from jaxckpt.format import _checksum

_BLOCK: Final = 1 << 20
_SOCKET_BUFFER: Final = 8 << 20


class _Mapping:
    """A pre-faulted tmpfs file of `size` bytes, mapped read-write (removed on close)."""

    def __init__(self, directory: Path, size: int):
        self.path = directory / f".floor-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            self._map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._map, np.uint8)
        self.view[:] = 1  # every page allocated and mapped before the clock starts

    def close(self) -> None:
        del self.view
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _bytes(a: Any) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(np.uint8)


class Floor:
    """`save(shards)` after each train step; `close()` after the loop.

    Args:
      directory: a tmpfs directory (the memory root) for the mappings.
      own_bytes: this process's bytes per save.
      ring: with replicas, `(listening socket, next process's port, previous
        process's bytes)`, every process's listening socket made before any
        connects (see `_phases`); None without.
      timeout_s: the longest any wait may take.
    """

    def __init__(
        self,
        directory: Path,
        own_bytes: int,
        ring: tuple[socket.socket, int, int] | None,
        timeout_s: float,
    ):
        self._own = _Mapping(directory, own_bytes)
        self._timeout_s = timeout_s
        self._work: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._send: socket.socket | None = None
        self._recv_thread: threading.Thread | None = None
        self._incoming: _Mapping | None = None
        self.crcs = 0  # checksums computed (kept so that nothing is optimized away)
        if ring is not None:
            server, next_port, prev_bytes = ring
            self._incoming = _Mapping(directory, prev_bytes)
            self._recv_thread = threading.Thread(
                target=self._receive_all,
                args=(server, prev_bytes),
                name="jaxckpt-bench-floor-recv",
                daemon=True,
            )
            self._recv_thread.start()
            self._send = socket.create_connection(("127.0.0.1", next_port), timeout=timeout_s)
            self._send.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._steps_sent = 0

    def save(self, shards: Sequence[Any]) -> None:
        """Waits for the previous save's work, then starts this one's in the background."""
        self.wait()
        held = [_bytes(s) for s in shards]  # held until copied: the next step may not donate them
        self._work = threading.Thread(
            target=self._guard(self._copy_and_send), args=(held,), name="jaxckpt-bench-floor"
        )
        self._work.start()

    def wait(self) -> None:
        if self._work is not None:
            self._work.join(self._timeout_s)
            if self._work.is_alive():
                raise TimeoutError(f"The floor's save took longer than {self._timeout_s:g} s.")
            self._work = None
        if self._errors:
            raise self._errors[0]

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as e:
                self._errors.append(e)

        return run

    def _copy_and_send(self, held: list[np.ndarray]) -> None:
        dest, offset = self._own.view, 0
        for src in held:
            for start in range(0, src.nbytes, _BLOCK):
                block = src[start : start + _BLOCK]
                dest[offset : offset + block.nbytes] = block
                self.crcs ^= _checksum.crc32c(block)
                offset += block.nbytes
        del held
        if self._send is not None:
            self._send.sendall(memoryview(dest[:offset]))  # type: ignore[arg-type]
            self._steps_sent += 1

    def _receive_all(self, server: socket.socket, prev_bytes: int) -> None:
        try:
            server.settimeout(self._timeout_s)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(self._timeout_s)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
                assert self._incoming is not None
                into = memoryview(self._incoming.view)  # type: ignore[arg-type]
                while True:  # one save's bytes after another, until the sender closes
                    done = 0
                    while done < prev_bytes:
                        end = min(done + _BLOCK, prev_bytes)
                        got = conn.recv_into(into[done:end])
                        if not got:
                            if done:
                                raise ConnectionResetError("The floor's replica was cut short.")
                            return
                        # A MiB received whole is checksummed while in cache.
                        while done + got < end:
                            more = conn.recv_into(into[done + got : end])
                            if not more:
                                raise ConnectionResetError("The floor's replica was cut short.")
                            got += more
                        self.crcs ^= _checksum.crc32c(into[done:end])
                        done = end
        except BaseException as e:
            self._errors.append(e)

    def close(self) -> None:
        """Ends the loop's work and frees the mappings; raises a failure of any save."""
        try:
            self.wait()
        finally:
            if self._send is not None:
                with contextlib.suppress(OSError):
                    self._send.shutdown(socket.SHUT_WR)
                self._send.close()
            if self._recv_thread is not None:
                self._recv_thread.join(self._timeout_s)
            self._own.close()
            if self._incoming is not None:
                self._incoming.close()
        if self._errors:
            raise self._errors[0]
