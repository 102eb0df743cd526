"""What the figures were measured on: the machine, its CPUs and memory, the filesystems
under the memory root and the persistent directory, and the package versions."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any, Final

import psutil

_PACKAGES: Final = ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy", "jaxckpt")


def _fs_type(path: str) -> str | None:
    """The type of the filesystem holding `path`, if known."""
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        # The longest mount point holding the path; of several at one point, the last.
        if inside and (best is None or len(mount) >= len(best[0])):
            best = (mount, part.fstype)
    return best[1] if best else None


def _cpu_model() -> str | None:
    # Neither psutil nor platform (`uname -p`, often empty on Linux) names the CPU model.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine(memory_root: str, work_dir: str) -> dict[str, Any]:
    """What the figures were measured on."""
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        usable: int | None = len(psutil.Process().cpu_affinity())
    except AttributeError:  # no CPU affinity on macOS
        usable = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": psutil.cpu_count(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "ram_bytes": psutil.virtual_memory().total,
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "versions": versions,
        "memory_root": memory_root,
        "memory_root_fs": _fs_type(memory_root),
        "persistent_dir": work_dir,
        "persistent_fs": _fs_type(work_dir),
    }
