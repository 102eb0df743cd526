"""One verdict on every process: a save or a restore fails everywhere or nowhere.

Orbax's CheckpointManager meets all processes at barriers right after the
handler's commit (`async_write_complete`) and after `restore`
(`Checkpointer:restore`). A process that raises while the others return would
leave them waiting there for Orbax's own barrier timeout. So before a commit
writes its index manifest, and before `restore` returns, every process says
whether it failed, through one bounded exchange (`_multihost.converge`), and
then all raise or none does. A process's own error is raised as it is; the
others raise the same built-in type with its message, naming the process.

A save also compares a digest of the tree each process saved: paths, kinds,
global shapes, dtypes and shardings (never values, which may differ per
process). Only when the digests differ are the leaves themselves exchanged,
to name the leaves that differ and the processes that saved them.

No process reads the others' verdicts or digests: each posts its own (nothing
but the digest when it did not fail), the decider (`_multihost`) compares them
and publishes one small outcome (the first failure, or which processes differ),
so a save moves O(N) bytes through the coordinator, a few hundred a process.

A save's agreement also writes the step's index: each process posts its part's
index entry with its digest (`_index.entry`: its chunk records, compressed),
and the process that decides writes the one combined index, only when every
process saved the same tree without failing, before it publishes the outcome.
A failed write is the outcome: every process raises. So a step is indexed by
every process or by none, with one object written whatever the process count.
"""

from __future__ import annotations

import builtins
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from jaxckpt import _resources
from jaxckpt.coord import _multihost
from jaxckpt.format import _format

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
    `tag`, whether or not it failed. Through the coordinator it moves O(N)
    bytes when no process gives a payload (see `_multihost.converge`).

    Args:
      error: this process's error, or None.
      tag: the exchange's tag (see `_multihost.converge`).
      what: what failed, for messages ("The restore of step 5").
      timeout_s: bound on the wait for the other processes.
      payload: a small JSON value to hand to every process (every process
        then reads every payload: O(N^2) bytes, compressed).

    Returns:
      Every process's payload, in process order, when no process failed.

    Raises:
      The error of this process if it failed, else one of the same built-in
      type as the first failing process's, naming it. If a process does not
      take part in time, this process's error or the exchange's TimeoutError.
    """
    count = _multihost.process_count()
    decided = _converge(error, tag=tag, what=what, timeout_s=timeout_s, payload=payload)
    return decided.get("payloads") or [None] * count


def agree_each(
    error: BaseException | None,
    *,
    tag: str,
    what: str,
    timeout_s: float,
    payload: Any,
    share: Callable[[list[Any]], dict[str, Any]],
) -> tuple[dict[str, Any], Any]:
    """`agree`, where no process reads every payload: the process that decides calls
    `share(payloads)` (every process's payload, in process order), which returns
    `{"all": a small dict for every process, "each": {process: its own share}}`.
    O(N) bytes through the coordinator when both are small
    (`_multihost.converge_each`).

    Returns:
      ("all", this process's share), when no process failed.

    Raises:
      As `agree`; a RuntimeError on every process if `share` raised.
    """
    if _multihost.process_count() == 1:
        if error is not None:
            raise error
        shared = share([payload])
        return shared["all"], shared["each"].get(0)
    mine: dict[str, Any] = {"p": payload} if error is None else {"e": _describe(error)}

    def combine(texts: dict[int, str]) -> dict[str, Any]:
        verdict = _combine(texts)
        payloads = verdict.pop("payloads", None)
        if "first" in verdict or payloads is None:
            # Every process still gets a share (an empty one): each waits for its own.
            return {"all": verdict, "each": dict.fromkeys(texts)}
        shared = share(payloads)
        return {"all": {**shared["all"], **verdict}, "each": shared["each"]}

    decided, got = _settle(
        error,
        what,
        lambda: _multihost.converge_each(
            json.dumps(mine, separators=(",", ":")), combine, tag=tag, timeout_s=timeout_s
        ),
    )
    if got is None:  # a share every process gets, unless the store lost it
        raise mark_agreed(
            ConnectionError(
                f"[process {_multihost.process_index()}] {what}: the coordination service "
                "lost this process's answer. Is the coordinator (process 0) still running?"
            )
        )
    return decided, got


def _converge(
    error: BaseException | None,
    *,
    tag: str,
    what: str,
    timeout_s: float,
    payload: Any = None,
    digest: str | None = None,
    entry: str | None = None,
    write_index: WriteIndex | None = None,
) -> dict[str, Any]:
    """`agree`, returning the combined outcome: "payloads" (if any process gave one) and,
    if the digests differ, "ref" (the lowest process of the most common digest) and "odd"
    (the processes with another digest). With `write_index`, the decider hands it every
    process's `entry` when none failed and all digests agree (see the module docstring)."""
    if _multihost.process_count() == 1:
        if error is not None:
            raise error
        if write_index is not None and entry is not None:
            write_index({0: entry})
        return {"payloads": [payload]} if payload is not None else {}
    mine: dict[str, Any] = {}
    if error is not None:
        mine["e"] = _describe(error)
    if payload is not None:
        mine["p"] = payload
    if digest is not None:
        mine["d"] = digest
    if entry is not None and error is None:
        mine["i"] = entry
    text = json.dumps(mine, separators=(",", ":")) if mine else ""
    combine: _multihost.Combine = _combine
    if write_index is not None:
        combine = lambda texts: _combine(texts, write_index)  # noqa: E731
    decided, _ = _settle(
        error,
        what,
        lambda: (_multihost.converge(text, combine, tag=tag, timeout_s=timeout_s), None),
    )
    return decided


def _settle(
    error: BaseException | None,
    what: str,
    converge: Callable[[], tuple[dict[str, Any], Any]],
) -> tuple[dict[str, Any], Any]:
    """Runs one exchange (`converge`: the outcome every process gets, and this one's
    share) and raises its verdict: this process's `error`, the first process's failure,
    or the exchange's own failure, on every process alike."""
    try:
        decided, share = converge()
    except (TimeoutError, ConnectionError, RuntimeError) as failed:
        # Every process that took part gets this error too (see _multihost), so all raise.
        if error is not None:
            raise mark_agreed(error) from failed
        raise mark_agreed(failed) from None
    if error is not None:
        raise mark_agreed(error)
    if "first" in decided:
        raise mark_agreed(_rebuild(decided, what))
    return decided, share


WriteIndex = Callable[[dict[int, str]], None]  # every process's index entry -> written


def _combine(texts: dict[int, str], write_index: WriteIndex | None = None) -> dict[str, Any]:
    """The outcome of an agreement, from every process's posted text (run by one process);
    with `write_index`, the step index written first when the save is agreed on."""
    values = {p: json.loads(t) for p, t in texts.items() if t}
    failed = sorted(p for p, v in values.items() if v.get("e") is not None)
    if failed:
        first = failed[0]
        return {"first": first, "error": values[first]["e"], "others": failed[1:]}
    out: dict[str, Any] = {}
    count = len(texts)
    if any("p" in v for v in values.values()):
        out["payloads"] = [values.get(p, {}).get("p") for p in range(count)]
    groups: dict[str, list[int]] = {"None": list(range(count))}
    if any("d" in v for v in values.values()):  # else (a restore's verdict) one group
        groups = {}
        for p in range(count):
            groups.setdefault(str(values.get(p, {}).get("d")), []).append(p)
    if len(groups) > 1:
        # The reference is the most common tree (ties: the lowest process's).
        reference = max(groups.values(), key=lambda ps: (len(ps), -ps[0]))
        out["ref"] = reference[0]
        out["odd"] = [p for p in range(count) if p not in set(reference)]
    elif write_index is not None:
        entries = {p: v.get("i") for p, v in values.items()}
        missing = [p for p in range(count) if not entries.get(p)]
        if missing:
            raise ValueError(f"processes {missing} gave no index entry for the step")
        # IMPORTANT: written before the outcome is published: a step is indexed by all or none.
        write_index({p: e for p, e in entries.items() if e})
    return out


def _describe(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _rebuild(decided: dict[str, Any], what: str) -> Exception:
    """The first failing process's error, as a built-in exception raised here."""
    me = _multihost.process_index()
    first, described, others = decided["first"], decided["error"], decided["others"]
    if len(others) > 16:
        also = f" (and on {len(others)} other processes, {others[:16]} first)"
    else:
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
    """A short digest of the tree's structure (paths, kinds, shapes, dtypes, shardings),
    once per tree (`_format.remembered`)."""
    return _format.remembered(_DIGESTS, leaves, lambda: _digest(leaves))


def _digest(leaves: Sequence[_format.LeafRecord]) -> str:
    text = json.dumps([leaf_signature(r) for r in leaves], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_DIGESTS: dict[int, tuple[object, str]] = _resources.SHARED.cache({})


def agree_on_save(
    leaves: Sequence[_format.LeafRecord] | None,
    error: BaseException | None,
    *,
    tag: str,
    step: int | None,
    timeout_s: float,
    entry: str | None = None,
    write_index: WriteIndex | None = None,
) -> None:
    """Raises on every process if any failed its part of the save or saved another tree.

    Collective. `leaves` is None on a process whose save failed before its snapshot.
    With `write_index`, the one process that decides calls it with every process's
    `entry` (process -> entry) once the save is agreed on, before any process
    returns; if it raises, every process raises (a RuntimeError with its message).

    Raises:
      ValueError: if the processes saved different trees, naming the leaves
        that differ and the processes that saved each version.
      Anything `agree` raises.
    """
    what = f"The save of step {step}"
    digest = tree_digest(leaves) if leaves is not None else None
    decided = _converge(
        error,
        tag=tag,
        what=what,
        timeout_s=timeout_s,
        digest=digest,
        entry=entry,
        write_index=write_index,
    )
    if "odd" not in decided:
        return
    assert leaves is not None  # no process failed, so every process has its leaves
    # Rare: find the leaves that differ. Only the reference process (the lowest of the
    # most common tree) and the processes that differ send their leaves; the process that
    # combines them sends back only the differing paths, and then their signatures.
    ref, odd = int(decided["ref"]), [int(p) for p in decided["odd"]]
    count = _multihost.process_count()
    outside = set(odd)
    reference = [p for p in range(count) if p not in outside]
    me = _multihost.process_index()
    sends = me == ref or me in outside
    sigs = {r.path: leaf_signature(r) for r in leaves}
    hashes = {p: _short(s) for p, s in sigs.items()}

    def differing(texts: dict[int, str]) -> list[str]:
        maps = {p: json.loads(t) for p, t in texts.items() if t}
        return _differing_paths(maps[ref], [maps[p] for p in odd])[:_SHOWN]

    paths = _multihost.converge(
        json.dumps(hashes) if sends else "", differing, tag=f"{tag}/leaves", timeout_s=timeout_s
    )
    shown = {p: sigs.get(p) for p in paths}

    def signatures(texts: dict[int, str]) -> list[tuple[int, Any]]:
        return [(p, json.loads(t)) for p, t in sorted(texts.items()) if t]

    pairs = _multihost.converge(
        json.dumps(shown) if sends else "", signatures, tag=f"{tag}/shown", timeout_s=timeout_s
    )
    full = {int(p): sig for p, sig in pairs}
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
    full: dict[int, dict[str, Any] | None],
) -> str:
    details = []
    for path in paths:
        versions: dict[str, tuple[list[int], dict[str, Any] | None]] = {}
        for p in [reference[0], *odd]:
            sig = (full.get(p) or {}).get(path)
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
