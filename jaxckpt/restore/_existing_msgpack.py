"""flax.training.checkpoints' legacy msgpack files, for `restore_existing`.

Which files in a directory are steps (only `checkpoint_<N>` exactly: a
`checkpoint_best` or `checkpoint_7.bak` beside them is not one), reading one
(a file that is not whole msgpack is blamed by its path, so the caller can try
an older step), and matching its tree to a target both ways: a saved leaf the
target lacks is refused by name, as the Orbax-format path does, instead of being
dropped.

Only flax reads the bytes (`flax.serialization`); flax is an extra, not a
dependency of jaxckpt, and without it there are no msgpack steps to find.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from etils import epath

# flax.training.checkpoints' default name prefix, and a step file's whole name.
PREFIX = "checkpoint_"
_STEP_NAME = re.compile(rf"{PREFIX}(\d+)")


class DamagedCheckpointError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be."""


def _serialization() -> Any:
    """`flax.serialization`, or None without flax."""
    try:
        from flax import serialization
    except ImportError:
        return None
    return serialization


def steps(root: epath.Path) -> dict[int, epath.Path]:
    """step -> path of every flax msgpack checkpoint file in `root`: files named
    `checkpoint_<N>`. Other names (`checkpoint_best`, `checkpoint_7.bak`, flax's
    temporary files) are not steps; flax's own listing fails on some of them."""
    if _serialization() is None:
        return {}
    found = {}
    for path in root.iterdir():
        match = _STEP_NAME.fullmatch(path.name)
        if match is not None and path.is_file():
            found[int(match.group(1))] = path
    return found


def read(step: int, path: epath.Path) -> Any:
    """The state dict the file at `path` holds.

    Raises:
      DamagedCheckpointError: naming the file, if it is not whole msgpack (a
        truncated or overwritten file).
    """
    serialization = _serialization()
    try:
        contents = path.read_bytes()
        return serialization.msgpack_restore(contents)
    except Exception as e:
        raise DamagedCheckpointError(
            f"Step {step}: the flax msgpack checkpoint {path} is damaged (truncated or "
            f"overwritten: {type(e).__name__}: {e}); it cannot be read whatever the target. "
            "Restore an older step (step=), or remove the file."
        ) from e


def restore(step: int, path: epath.Path, saved: Any, target: Any) -> Any:
    """`saved` (the state dict `read` returned) in the structure of `target`, leaves as
    flax reads them (host arrays); every saved leaf must have a place in `target`.

    Raises:
      ValueError: naming the first leaf the saved tree has and the target lacks, or
        the other way round, or the mismatch flax found.
    """
    serialization = _serialization()
    where = f"Step {step} at {path} (a flax msgpack checkpoint)"
    held = _flat(saved)
    wanted = _flat(serialization.to_state_dict(target))
    require_same_leaves(
        where, held, wanted, "Pass a target with the tree the old loop saved", "the optimizer state"
    )
    try:
        return serialization.from_state_dict(target, saved)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{where} does not match the target: {e}. Pass a target with the tree the old "
            "loop saved."
        ) from e


def _flat(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """A state dict's leaves by key path (an empty dict holds none)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, (*prefix, str(key))))
    return out


def require_same_leaves(
    where: str,
    saved: Mapping[tuple[str, ...], Any],
    wanted: Mapping[tuple[str, ...], Any],
    advice: str,
    also: str,
) -> None:
    """Raises ValueError naming the first leaf the saved tree holds and the target lacks
    (restoring would drop it), or the target has and the saved tree lacks.

    Args:
      where: the step and path, to start the message.
      saved, wanted: flat trees (key path -> leaf) of the checkpoint and the target.
      advice: what to pass instead ("Pass a target with ...").
      also: what the old loop may have saved besides (named in the advice).
    """
    extra = [k for k in saved if k not in wanted]
    if extra:
        raise ValueError(
            f"{where} holds leaf {'.'.join(extra[0])!r}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + f" that the target lacks; restoring would drop it. {advice} ({also} too, "
            "if it saved one)."
        )
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise ValueError(
            f"{where} has no leaf {'.'.join(missing[0])!r}"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f", which the target has; it holds {_names(saved)}. {advice}."
        )


def _names(flat: Mapping[tuple[str, ...], Any]) -> str:
    names = [".".join(k) for k in flat]
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
