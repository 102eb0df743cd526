"""`manager_options`: the CheckpointManagerOptions a checkpoint URL needs."""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from jaxckpt import _storage


def manager_options(directory: str | os.PathLike[str], **options: Any) -> Any:
    """`ocp.CheckpointManagerOptions(**options)`, plus what `directory`'s store needs.

    On S3 (and S3-compatible stores: MinIO, R2, ...) a directory cannot be
    renamed, so the manager must finalize steps with a commit file
    (`ocp.path.atomicity.CommitFileTemporaryPath`); Orbax already does so on
    `gs://`. A local directory needs nothing extra.

        mngr = ocp.CheckpointManager(
            "s3://bucket/run", item_handlers={"train": handler},
            options=jaxckpt.manager_options("s3://bucket/run", max_to_keep=3))

    Args:
      directory: the checkpoint directory or URL the manager is given.
      **options: any `ocp.CheckpointManagerOptions` field.

    Raises:
      ValueError: if `options` sets a `temporary_path_class` that renames
        directories for an S3 URL.
    """
    if _storage.scheme(directory) == "s3":
        commit_file = ocp.path.atomicity.CommitFileTemporaryPath
        given = options.setdefault("temporary_path_class", commit_file)
        if given is not None and not (isinstance(given, type) and issubclass(given, commit_file)):
            raise ValueError(
                f"{directory} is on S3, where a directory cannot be renamed: "
                f"temporary_path_class must be {commit_file.__name__}, not {given!r}. "
                "Leave it out and manager_options sets it."
            )
    return ocp.CheckpointManagerOptions(**options)
