"""The benchmark: what a checkpoint every step costs, against baselines measured in the same run.

`python -m jaxckpt.bench` or `jaxckpt bench`. The driver (`_run`) starts the worker
processes (`_worker`, started and stopped with `jaxckpt.launch._supervise`), which build
the state (`_state`), run the phases (`_phases`, `_restores`, `_many_leaves`) on
jaxckpt's and Orbax's managers (`_managers`) and measure the raw baselines
(`_baselines`); with an object store, `_object_store` persists to it against plain
tensorstore writes (`_emulator` starts a local one); `_results` turns their results into
figures (`_figure`), which the driver prints with what they ran on (`_machine`). `--gpu`
runs `_gpu` instead: one process on an accelerator; `--scale` runs `_scale`: coordination
at thousands of processes against a simulated coordinator (`_coordinator`).
"""

from jaxckpt.bench._run import main as main

__all__ = ["main"]
