"""Raw baselines of the benchmark and the host-memory sampler.

Each baseline moves the same bytes as the jaxckpt figure it is compared with,
with the plainest tool for the job, in the same process and the same run:
files written into the memory tier's tmpfs, a copy into a tmpfs file whose
pages are already allocated, files written and fsync'd where checkpoints
persist, and a TCP stream over loopback to the next process.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import psutil

from jaxckpt.format import _checksum

_SOCKET_BUFFER: Final = 8 << 20


def write_files(arrays: Sequence[np.ndarray], directory: Path, *, fsync: bool) -> float:
    """Seconds to write each array to its own new file under `directory` (then removed)."""
    target = directory / f".raw-{uuid.uuid4().hex[:8]}"
    target.mkdir(parents=True)
    try:
        start = time.perf_counter()
        for i, a in enumerate(arrays):
            fd = os.open(target / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = _bytes(a)
                while view:
                    view = view[os.write(fd, view) :]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if fsync:
            _fsync_dir(target)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(target, ignore_errors=True)


def prefaulted_copy(arrays: Sequence[np.ndarray], directory: Path) -> float:
    """Seconds to copy each array into one existing, pre-faulted tmpfs file.

    The file (the arrays' total size, under `directory`) is created, mapped and
    written once before the clock starts, so its pages are allocated and mapped:
    what is timed is one `memcpy` of every array into its place in the mapping,
    on one thread. This is what the memory tier's write does once it reuses a
    retired step's slab (without its checksums). The file is removed afterwards.
    """
    views = [_bytes(a) for a in arrays]
    size = sum(v.nbytes for v in views)
    path = directory / f".raw-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not size:
            return 0.0
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mapped:
            dest = np.frombuffer(mapped, np.uint8)
            dest[:] = 1  # every page allocated, zeroed by the kernel and mapped
            start = time.perf_counter()
            offset = 0
            for v in views:
                dest[offset : offset + v.nbytes] = np.frombuffer(v, np.uint8)
                offset += v.nbytes
            seconds = time.perf_counter() - start
            del dest
        return seconds
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def checksum(arrays: Sequence[np.ndarray]) -> float:
    """Seconds to compute the CRC-32C of every array on one thread (what a save
    must add to its copy, and a holder to each replica it receives)."""
    views = [_bytes(a) for a in arrays]
    start = time.perf_counter()
    for v in views:
        _checksum.crc32c(v)
    return time.perf_counter() - start


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of an array in C order, whatever its dtype (bfloat16 included)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listen() -> socket.socket:
    """A loopback listening socket for `ring_transfer` (its port goes to the other processes)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server


def ring_transfer(
    server: socket.socket,
    next_port: int,
    arrays: Sequence[np.ndarray],
    barrier: Callable[[], None],
    timeout_s: float,
) -> float:
    """Seconds for every process to send `arrays` to the next one over raw TCP at once.

    Mirrors a replica push: each process sends its bytes to the next process and
    receives the previous one's, all at the same time, with `sendall`/`recv_into`.
    """
    nbytes = sum(a.nbytes for a in arrays)
    received: list[BaseException | int] = []

    def receive() -> None:
        try:
            server.settimeout(timeout_s)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
                buf = memoryview(bytearray(_SOCKET_BUFFER))
                total = 0
                while (got := conn.recv_into(buf)) > 0:
                    total += got
                received.append(total)
        except BaseException as e:
            received.append(e)

    thread = threading.Thread(target=receive, name="jaxckpt-bench-recv", daemon=True)
    thread.start()
    barrier()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", next_port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for a in arrays:
            conn.sendall(_bytes(a))
    thread.join(timeout_s)
    seconds = time.perf_counter() - start
    if thread.is_alive() or not received:
        raise TimeoutError(f"The loopback baseline received nothing within {timeout_s:.0f} s.")
    if isinstance(received[0], BaseException):
        raise received[0]
    if received[0] <= 0 or nbytes <= 0:
        raise OSError("The loopback baseline moved no bytes.")
    return seconds


def evict_page_cache(root: Path) -> None:
    """Asks the kernel to drop cached pages of every file under `root` (cold reads)."""
    os.sync()
    if not hasattr(os, "posix_fadvise"):
        return
    for dirpath, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def tree_bytes(root: Path) -> int:
    """Bytes allocated by the files under `root` (tmpfs usage)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


@functools.cache
def _process(pid: int) -> psutil.Process:
    return psutil.Process(pid)


def rss_bytes() -> int:
    """This process's private resident memory now: its resident set less the pages of
    mapped files (`shared`: shared libraries, and the tmpfs slabs it maps while writing
    or receiving them, which `tree_bytes` counts already)."""
    info = _process(os.getpid()).memory_info()
    return int(info.rss - getattr(info, "shared", 0))


class MemorySampler:
    """Samples this process's RSS and its memory tier's tmpfs bytes on a thread."""

    def __init__(self, memory_root: Path, interval_s: float = 0.05):
        self._root = memory_root
        self._interval_s = interval_s
        self._peaks: dict[str, float] = {}
        self._phase: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxckpt-bench-mem", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def phase(self, name: str, rss_floor: int = 0) -> Iterator[dict[str, float]]:
        """Tracks peak RSS, peak tmpfs and peak (RSS - rss_floor + tmpfs) while open."""
        peaks = {"rss": 0.0, "tmpfs": 0.0, "combined": 0.0, "floor": float(rss_floor)}
        with self._lock:
            self._phase, self._peaks = name, peaks
        try:
            yield peaks
        finally:
            self._sample()
            with self._lock:
                self._phase = None

    def _sample(self) -> None:
        rss, tmpfs = rss_bytes(), tree_bytes(self._root)
        with self._lock:
            if self._phase is None:
                return
            p = self._peaks
            p["rss"] = max(p["rss"], rss)
            p["tmpfs"] = max(p["tmpfs"], tmpfs)
            p["combined"] = max(p["combined"], rss - p["floor"] + tmpfs)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()
