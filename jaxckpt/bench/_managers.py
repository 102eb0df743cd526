"""The checkpoint managers the benchmark compares: jaxckpt's tiered handler and Orbax's.

Both run in Orbax's `CheckpointManager` with the same async options, so that the
figures compare the handlers, not the manager's settings. The options come from
`jaxckpt.manager_options`, so a directory may also be an object-store URL (gs://, s3://).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

import jaxckpt


class Jaxckpt:
    """A CheckpointManager around a `TieredCheckpointHandler`, and the metrics it reported."""

    def __init__(
        self, directory: Path | str, memory_root: Path, cfg: dict[str, Any], **options: Any
    ):
        max_to_keep = options.pop("max_to_keep", None)
        self.timeout_s: float = cfg["timeout_s"]
        self.events: list[dict[str, Any]] = []  # appended from the commit and persist threads
        self.handler = jaxckpt.TieredCheckpointHandler(
            jaxckpt.TierOptions(
                str(memory_root), replicas=cfg["replicas"], timeout_s=cfg["timeout_s"], **options
            ),
            on_metrics=self.events.append,
        )
        self.mngr = ocp.CheckpointManager(
            directory,
            item_handlers={"train": self.handler},
            options=manager_options(directory, cfg, max_to_keep, self.handler),
        )

    @classmethod
    def every_step(
        cls,
        directory: Path,
        memory_root: Path,
        cfg: dict[str, Any],
        hold: bool = False,
        count_nonfinite: bool = True,
    ) -> Jaxckpt:
        """As the training loops save: every step, `memory_keep=1`, nothing persisted
        (`hold`: `TierOptions.hold_cpu_arrays`; `count_nonfinite`: the option)."""
        return cls(
            directory,
            memory_root,
            cfg,
            persist_every=10**9,
            memory_keep=1,
            max_to_keep=2,
            hold_cpu_arrays=hold,
            count_nonfinite=count_nonfinite,
        )

    @property
    def memory_dir(self) -> Path | None:
        """This process's memory-tier run directory: removed by the benchmark once
        closed and no other process may still read it."""
        memory = self.handler.inspect().memory
        return memory.run_dir if memory is not None else None

    def save(self, step: int, state: Any) -> None:
        self.mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))

    def metrics(self, event: str, step: int | None = None) -> list[dict[str, Any]]:
        """The reported metrics of one kind ("save", "persist"), optionally of one step."""
        return [
            dict(m)
            for m in list(self.events)
            if m.get("event") == event and (step is None or m.get("step") == step)
        ]

    def close(self) -> None:
        self.mngr.close()


def orbax_manager(directory: Path, cfg: dict[str, Any], max_to_keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        directory,
        item_handlers=ocp.StandardCheckpointHandler(),
        options=manager_options(directory, cfg, max_to_keep),
    )


def manager_options(
    directory: Path | str,
    cfg: dict[str, Any],
    max_to_keep: int | None,
    handler: jaxckpt.TieredCheckpointHandler | None = None,
) -> Any:
    # What the directory's store needs as well (a commit file instead of a rename on S3),
    # and with jaxckpt's handler a collection that keeps the newest durable step; the
    # async options a user of `jaxckpt.manager_options` gets (a local directory's step
    # directories made in save()), with the benchmark's timeout. The same for Orbax's.
    options = jaxckpt.manager_options(
        directory, handler=handler, max_to_keep=max_to_keep, enable_async_checkpointing=True
    )
    return dataclasses.replace(
        options,
        async_options=dataclasses.replace(
            options.async_options or ocp.AsyncOptions(), timeout_secs=int(cfg["timeout_s"])
        ),
    )
