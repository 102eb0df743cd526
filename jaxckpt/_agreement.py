"""One verdict on every process: a save or a restore fails everywhere or nowhere.

Orbax's CheckpointManager meets all processes at barriers right after the
handler's commit (`async_write_complete`) and after `restore`
(`Checkpointer:restore`). A process that raises while the others return would
leave them waiting there for Orbax's own barrier timeout. So before a commit
writes its index manifest, and before `restore` returns, every process says
whether it failed, through one bounded exchange (`_multihost.allgather`), and
then all raise or none does. A process's own error is raised as it is; the
others raise the same built-in type with its message, naming the process.

A save also compares a digest of the tree each process saved: paths, kinds,
global shapes, dtypes and shardings (never values, which may differ per
process). Only when the digests differ are the leaves themselves exchanged,
to name the leaves that differ and the processes that saved them.
"""

from __future__ import annotations

import builtins
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from jaxckpt import _format, _multihost, _resources

_SHOWN = 5  # differing leaves named in an error
is_agreed = _multihost.is_agreed
mark_agreed = _multihost.mark_agreed


def agree(
    error: BaseException | None,
    *,
    tag: str,
    what: str,
    timeout_s: float,
    payload: Any = None,
) -> list[Any]:
    """Tells every process whether this one failed `what`; raises on all if any did.

    Collective: every process calls it once per save or restore, with the same
    `tag`, whether or not it failed.

    Args:
      error: this process's error, or None.
      tag: the exchange's tag (see `_multihost.allgather`).
      what: what failed, for messages ("The restore of step 5").
      timeout_s: bound on the wait for the other processes.
      payload: a small JSON value to hand to every process.

    Returns:
      Every process's payload, in process order, when no process failed.

    Raises:
      The error of this process if it failed, else one of the same built-in
      type as the first failing process's, naming it. If a process does not
      take part in time, this process's error or the exchange's TimeoutError.
    """
    if _multihost.process_count() == 1:
        if error is not None:
            raise error
        return [payload]
    mine = {"error": _describe(error) if error is not None else None, "payload": payload}
    try:
        everyone = _multihost.allgather(mine, tag=tag, timeout_s=timeout_s)
    except (TimeoutError, ConnectionError) as failed:
        # Every process that took part gets this error too (see _multihost), so all raise.
        if error is not None:
            raise mark_agreed(error) from failed
        raise mark_agreed(failed) from None
    if error is not None:
        raise mark_agreed(error)
    failures = {p: v["error"] for p, v in enumerate(everyone) if v["error"] is not None}
    if failures:
        raise mark_agreed(_rebuild(failures, what))
    return [v["payload"] for v in everyone]


def _describe(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _rebuild(failures: dict[int, dict[str, str]], what: str) -> Exception:
    """The first failing process's error, as a built-in exception raised here."""
    me = _multihost.process_index()
    first = min(failures)
    described = failures[first]
    others = sorted(failures)[1:]
    also = f" (and on processes {others})" if others else ""
    message = (
        f"[process {me}] {what} failed on process {first}{also}, so it fails on every process: "
        f"{described['type']}: {described['message']}"
    )
    kind = getattr(builtins, described["type"], None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except TypeError:  # a built-in that takes other arguments
            pass
    return RuntimeError(message)


# ---- the saved tree ---------------------------------------------------------------


def leaf_signature(record: _format.LeafRecord) -> dict[str, Any]:
    """What must be identical on every process for one leaf: not its value."""
    sig = record.to_dict()
    sig.pop("value", None)
    if getattr(record, "per_process", False):
        # Each process saves its own value, with its own (process-local) sharding.
        for name in ("sharding", "scalar_type", "uncommitted"):
            sig.pop(name, None)
    return sig


def tree_digest(leaves: Sequence[_format.LeafRecord]) -> str:
    """A short digest of the tree's structure (paths, kinds, shapes, dtypes, shardings).

    Remembered for the last tree (by identity: the snapshot hands the same tuple
    to every save of an unchanged tree).
    """
    if _LAST_DIGEST and _LAST_DIGEST[0][0] is leaves:
        return _LAST_DIGEST[0][1]
    text = json.dumps([leaf_signature(r) for r in leaves], sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    _LAST_DIGEST[:] = [(leaves, digest)]
    return digest


_LAST_DIGEST: list[tuple[Sequence[_format.LeafRecord], str]] = _resources.SHARED.cache([])


def agree_on_save(
    leaves: Sequence[_format.LeafRecord] | None,
    error: BaseException | None,
    *,
    tag: str,
    step: int | None,
    timeout_s: float,
) -> None:
    """Raises on every process if any failed its part of the save or saved another tree.

    Collective. `leaves` is None on a process whose save failed before its snapshot.

    Raises:
      ValueError: if the processes saved different trees, naming the leaves
        that differ and the processes that saved each version.
      Anything `agree` raises.
    """
    what = f"The save of step {step}"
    digest = tree_digest(leaves) if leaves is not None else None
    digests = agree(error, tag=tag, what=what, timeout_s=timeout_s, payload=digest)
    if len(set(digests)) == 1:
        return
    assert leaves is not None  # no process failed, so every process has its leaves
    # Rare: find the leaves that differ. The reference is the most common tree (ties: the
    # lowest process's); only it and the processes that differ send their leaves.
    groups: dict[str, list[int]] = {}
    for p, d in enumerate(digests):
        groups.setdefault(d, []).append(p)
    reference = max(groups.values(), key=lambda ps: (len(ps), -ps[0]))
    ref = reference[0]
    me = _multihost.process_index()
    sends = me == ref or me not in reference
    sigs = {r.path: leaf_signature(r) for r in leaves}
    hashes = {p: _short(s) for p, s in sigs.items()}
    maps = _multihost.allgather(hashes if sends else None, tag=f"{tag}/leaves", timeout_s=timeout_s)
    odd = [p for p in range(len(digests)) if p not in reference]
    paths = _differing_paths(maps[ref], [maps[p] for p in odd])[:_SHOWN]
    shown = {p: sigs.get(p) for p in paths} if sends else None
    full = _multihost.allgather(shown, tag=f"{tag}/shown", timeout_s=timeout_s)
    raise mark_agreed(ValueError(_tree_message(me, step, reference, odd, paths, full)))


def _short(sig: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:12]


def _differing_paths(ref: dict[str, str], others: list[dict[str, str]]) -> list[str]:
    out: list[str] = []
    for other in others:
        for path in sorted(set(ref) | set(other)):
            if ref.get(path) != other.get(path) and path not in out:
                out.append(path)
    return out


def _tree_message(
    me: int,
    step: int | None,
    reference: list[int],
    odd: list[int],
    paths: list[str],
    full: list[dict[str, Any] | None],
) -> str:
    details = []
    for path in paths:
        versions: dict[str, tuple[list[int], dict[str, Any] | None]] = {}
        for p in [reference[0], *odd]:
            sig = (full[p] or {}).get(path)
            key = json.dumps(sig, sort_keys=True)
            group = reference if p == reference[0] else [p]
            versions.setdefault(key, ([], sig))[0].extend(group)
        details.append(f"leaf {path or '<root>'}: " + "; ".join(_versions(list(versions.values()))))
    if not details:
        details.append("They hold the same leaves in a different order (another container type)")
    return (
        f"[process {me}] The processes saved different trees at step {step}, so the step is "
        f"not saved (a restore could not build one tree from it): processes {reference} saved "
        f"one tree and processes {odd} another. "
        + "; ".join(details)
        + ". Every process must save the same leaves with the same global shapes, dtypes and "
        "shardings (values may differ only in process-local arrays, numpy arrays and scalars); "
        "fix the state and save again."
    )


def _versions(versions: list[tuple[list[int], dict[str, Any] | None]]) -> list[str]:
    """'processes [0, 2] save shape (8,)...' for each version of one leaf, naming only the
    fields that differ between the versions."""
    present = [sig for _, sig in versions if sig is not None]
    fields = sorted({k for sig in present for k in sig})
    differing = [
        k for k in fields if len({json.dumps(s.get(k), sort_keys=True) for s in present}) > 1
    ]
    out = []
    for processes, sig in versions:
        if sig is None:
            out.append(f"processes {sorted(processes)} do not save it")
        else:
            shown = ", ".join(f"{k}={sig.get(k)}" for k in differing if k not in ("keys",))
            out.append(
                f"processes {sorted(processes)} save it" + (f" with {shown}" if shown else "")
            )
    return out
