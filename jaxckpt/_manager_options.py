"""`manager_options`: the CheckpointManagerOptions a checkpoint directory and its
jaxckpt handler need."""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from jaxckpt._handler import TieredCheckpointHandler
from jaxckpt.persistent import _storage


def manager_options(
    directory: str | os.PathLike[str],
    *,
    handler: TieredCheckpointHandler | None = None,
    **options: Any,
) -> Any:
    """`ocp.CheckpointManagerOptions(**options)`, plus what `directory`'s store and
    `handler` need.

    With `handler`, garbage collection keeps the newest step every process has
    persisted, and every newer step to be persisted, whatever `max_to_keep`,
    `keep_period`, `keep_time_interval` or `preservation_policy` say (they become
    the base of `handler.preservation_policy`):

        options=jaxckpt.manager_options(path, handler=handler, max_to_keep=3)

    On S3 (and S3-compatible stores: MinIO, R2, ...) a directory cannot be
    renamed, so the manager must finalize steps with a commit file
    (`ocp.path.atomicity.CommitFileTemporaryPath`); Orbax already does so on
    `gs://`.

        mngr = ocp.CheckpointManager(
            "s3://bucket/run", item_handlers={"train": handler},
            options=jaxckpt.manager_options("s3://bucket/run", max_to_keep=3))

    A local directory without `async_options` gets
    `ocp.AsyncOptions(create_directories_asynchronously=False)`: the manager makes
    a step's directories while `save()` runs, one thread and its signals fewer a
    save than in the background (measured: the call 1-2 ms shorter). On an object
    store a directory is a request, so there they stay in the background. Given
    `async_options` are used as they are.

    Args:
      directory: the checkpoint directory or URL the manager is given.
      handler: the `TieredCheckpointHandler` of the manager's items; without it
        the options delete steps as Orbax alone would.
      **options: any `ocp.CheckpointManagerOptions` field.

    Raises:
      ValueError: if `options` sets a `temporary_path_class` that renames
        directories for an S3 URL, or `enable_background_delete=True` (the manager
        would delete steps at any moment, also while a persisted part enters one).
    """
    if options.get("enable_background_delete"):
        raise ValueError(
            "enable_background_delete=True is not supported with jaxckpt: the manager "
            "would delete steps on a thread of its own at any moment, also while a "
            f"persisted part enters its step directory in {directory}. Leave it out: "
            "the manager then deletes old steps at the end of each save."
        )
    if _storage.scheme(directory) == "s3":
        commit_file = ocp.path.atomicity.CommitFileTemporaryPath
        given = options.setdefault("temporary_path_class", commit_file)
        if given is not None and not (isinstance(given, type) and issubclass(given, commit_file)):
            raise ValueError(
                f"{directory} is on S3, where a directory cannot be renamed: "
                f"temporary_path_class must be {commit_file.__name__}, not {given!r}. "
                "Leave it out and manager_options sets it."
            )
    if _storage.scheme(directory) is None and "async_options" not in options:
        options["async_options"] = ocp.AsyncOptions(create_directories_asynchronously=False)
    if handler is not None:
        base = options.pop("preservation_policy", None) or _base_policy(options)
        options["preservation_policy"] = handler.preservation_policy(base, directory)
    return ocp.CheckpointManagerOptions(**options)


def _base_policy(options: dict[str, Any]) -> Any:
    """The policy Orbax builds from the older delete options, which it refuses beside a
    `preservation_policy`: they are taken out of `options`."""
    policies = ocp.checkpoint_managers
    max_to_keep = options.pop("max_to_keep", None)
    keep_period = options.pop("keep_period", None)
    keep_time_interval = options.pop("keep_time_interval", None)
    chosen: list[Any] = []
    if keep_period is not None:
        chosen.append(policies.EveryNSteps(keep_period))
    if keep_time_interval is not None:
        chosen.append(policies.EveryNSeconds(int(keep_time_interval.total_seconds())))
    if options.get("best_fn") is not None:
        chosen.append(
            policies.BestN(
                get_metric_fn=options["best_fn"],
                reverse=options.get("best_mode", "max") == "min",
                n=max_to_keep,
                keep_checkpoints_without_metrics=options.get(
                    "keep_checkpoints_without_metrics", True
                ),
            )
        )
    else:
        chosen.append(policies.LatestN(n=max_to_keep))
    return policies.AnyPreservationPolicy(chosen)
