"""Whether the process that left something behind still runs.

A pid alone cannot tell: pids are reused, and a pid recorded in another pid
namespace (another container sharing the same tmpfs) names an unrelated
process here, or none. Two sound ways are used instead:

- a lock (`HeldFile`, `is_held`): an exclusive `flock` on a file, held by an
  open descriptor for as long as its holder lives; the kernel drops it when the
  holder's process ends, whatever its pid namespace. Memory-tier pins use it.
- a record (`record`, `is_gone`): the pid with the process's start time, its pid
  namespace and the boot it runs in, written into a name. A record is judged
  gone only when that is certain: same boot and pid namespace, and no process
  with that pid and start time. A record of another namespace or boot is never
  judged (its owner may be alive where this process cannot look).

Temporary entries are named with their maker's record (`owned_name`, `maker`):
the peer service's receive directories and the memory tier's staging and trash
directories, so that whoever finds one left by a crash removes it as soon as
its maker is certainly gone, however young it is (a restarted process comes
back within seconds), and never while its maker runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import uuid
from pathlib import Path

import psutil


class HeldFile:
    """A file that `is_held` reports as held for as long as this object is not
    released and its process lives."""

    def __init__(self, path: Path):
        """Creates `path`, already locked, so that no one ever sees it unlocked.

        The file stays empty: writing into it would take a page of its
        filesystem, and a full tmpfs has none to give (name it after its holder,
        `record`, for a human looking at it).

        Raises:
          OSError: if the file cannot be created in its directory.
        """
        self.path = path
        tmp = path.with_name(f".lock-tmp-{uuid.uuid4().hex}")
        self._fd: int | None = os.open(tmp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            # IMPORTANT: locked before it gets its name, so `is_held` never sees it free.
            os.rename(tmp, path)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise

    def release(self) -> None:
        """Removes the file and drops the lock; idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __repr__(self) -> str:
        return f"HeldFile({str(self.path)!r}, held={self._fd is not None})"


def is_held(path: Path) -> bool:
    """Whether a live `HeldFile` (of any process, any pid namespace) holds `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def record(pid: int | None = None) -> str:
    """`<pid>.<start>.<pid namespace>.<boot>` of this process: no '-' or '/' in it.

    `start` is the process's start time in hundredths of a second; the pid
    namespace and boot are "0" where the system does not tell them.
    """
    return _own_record(os.getpid()) if pid is None else _record(pid)


@functools.lru_cache(maxsize=4)
def _own_record(pid: int) -> str:
    return _record(pid)  # this process's (keyed by pid: a forked child has its own)


def _record(pid: int) -> str:
    return f"{pid}.{_start_cs(pid)}.{_pid_namespace()}.{_boot_id()}"


def owned_name(what: str, prefix: str = "") -> str:
    """A fresh entry name `<prefix><record>-<what>-<random>` that tells who made it
    (`maker`). `what` holds no '-' or '/'."""
    return f"{prefix}{_own_record(os.getpid())}-{what}-{uuid.uuid4().hex}"


def maker(name: str, prefix: str = "") -> str | None:
    """The record of the process that made an `owned_name` (with `prefix`); None for
    any other name."""
    if not name.startswith(prefix):
        return None
    text = name.removeprefix(prefix).split("-", 1)[0]
    return text if _parse(text) is not None else None


def is_gone(text: str) -> bool:
    """Whether the process a `record` names has certainly ended.

    False when it may still run: it does, the record is not one of `record`'s,
    or it comes from another boot or pid namespace, where its pid means nothing.
    """
    return judge(text) is True


def judge(text: str) -> bool | None:
    """Whether the process a `record` names has ended: True (certainly), False (it
    runs), None (not for this process to tell: not a record, or one of another boot
    or pid namespace, where its pid means nothing)."""
    parsed = _parse(text)
    if parsed is None:
        return None
    pid, start, namespace, boot = parsed
    if namespace != _pid_namespace() or boot != _boot_id():
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True  # ended; only its exit status is left
        # A pid reused by a later process has another start time.
        return abs(_start_cs(pid) - start) > 1
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False  # it runs, as another user


def _parse(text: str) -> tuple[int, int, str, str] | None:
    try:
        pid_text, start_text, namespace, boot = text.split(".")
        return int(pid_text), int(start_text), namespace, boot
    except ValueError:
        return None


def _start_cs(pid: int) -> int:
    return round(psutil.Process(pid).create_time() * 100)


@functools.cache
def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
    except OSError:
        return "0"
