"""`python -m jaxckpt.bench --gpu`: the data path on one accelerator, in a few minutes.

    PYTHONPATH=. python -m jaxckpt.bench --gpu                 # 3 GiB params + adam
    PYTHONPATH=. python -m jaxckpt.bench --gpu --state-gib 1 --json gpu.json

One process, every local device, no grain and nothing to install beyond jax,
orbax-checkpoint, tensorstore, optax and `crc32c`. It trains the benchmark's MLP
(optax adam, `_state`) and measures, each against a baseline of the same run:

- g1 how long `mngr.save()` blocks with jaxckpt, against the floor: one batched
  `device_put` of this process's shards to `pinned_host` memory (the pool warm);
- g2 the same for Orbax's async `StandardSave` (for reference);
- g3 restoring the latest step from jaxckpt's memory tier, against Orbax
  restoring it from its directory (both checked bitwise against the state);
- g6 the host->device copy that ends a restore, through `pinned_host` memory
  against straight from pageable host buffers as the restore does now (the JSON
  also has the first, cold-pool time): whether staging restores through pinned
  memory would pay;
- g4 the training loop saving with jaxckpt every `--save-every` steps, against
  the same loop without saves; g5 the same with Orbax.

On CPU (`--platform cpu`, a tiny state) it runs the same code, which is how the
test suite keeps it working; its figures mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import jax
import numpy as np
import orbax.checkpoint as ocp

import jaxckpt
from jaxckpt.bench import _figure, _managers, _state

_TARGETS: Final = {"g1": "<= 2", "g3": "<= 0.5", "g4": "<= 1.05"}
# Each figure: id, name (`{every}`: --save-every), the raw timings' keys of its value and
# of its baseline, and what the baseline is; in the table's order.
_FIGURES: Final = (
    (
        "g1",
        "jaxckpt mngr.save() blocks",
        "jaxckpt_save_block_s",
        "pinned_floor_s",
        "device_put to pinned_host (warm)",
    ),
    (
        "g2",
        "Orbax mngr.save() blocks",
        "orbax_save_block_s",
        "pinned_floor_s",
        "device_put to pinned_host (warm)",
    ),
    (
        "g3",
        "restore latest from memory",
        "jaxckpt_restore_s",
        "orbax_restore_s",
        "Orbax restore from its directory",
    ),
    (
        "g6",
        "host->device through pinned_host (warm)",
        "h2d_via_pinned_s",
        "h2d_direct_s",
        "host->device from pageable buffers",
    ),
    (
        "g4",
        "step time, jaxckpt save every {every}",
        "jaxckpt_loop_step_s",
        "no_save_step_s",
        "step time without saves",
    ),
    (
        "g5",
        "step time, Orbax save every {every}",
        "orbax_loop_step_s",
        "no_save_step_s",
        "step time without saves",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxckpt bench --gpu", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--state-gib", type=float, default=3.0, help="params + adam state, GiB")
    p.add_argument("--batch-per-device", type=int, default=256)
    p.add_argument("--saves", type=int, default=4, help="isolated saves of each manager")
    p.add_argument("--loop-steps", type=int, default=40, help="steps per training loop")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--memory-root", default=None, help="default: a new dir in /dev/shm")
    p.add_argument("--work-dir", default=None, help="default: a new temp dir")
    p.add_argument("--platform", choices=("default", "cpu"), default="default")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")  # before any backend starts
    devices = jax.local_devices()
    memory_root = Path(args.memory_root or tempfile.mkdtemp(prefix="jaxckpt-gpu-", dir=_shm()))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxckpt-gpu-work-"))
    cfg = {"replicas": 0, "timeout_s": args.timeout}
    print(f"jaxckpt GPU check on {len(devices)} x {devices[0].device_kind}", file=sys.stderr)
    training = _state.build(_state.shape_for(args.state_gib, len(devices), args.batch_per_device))
    state_bytes = sum(s.nbytes for s in _state.own_shards(training.state(0)))
    try:
        raw = _measure(training, memory_root, work, cfg, args)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    figs = _figures(raw, args.save_every)
    print(_figure.table(figs))
    if args.json:
        report = _json_report(devices, state_bytes, raw, figs)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _figures(raw: dict[str, Any], save_every: int) -> list[_figure.Figure]:
    """The figures of `_FIGURES` from the raw timings."""
    return [
        _figure.Figure(
            id_,
            name.format(every=save_every),
            raw[value],
            "s",
            raw[baseline],
            baseline_name,
            _TARGETS.get(id_),
        )
        for id_, name, value, baseline, baseline_name in _FIGURES
    ]


def _json_report(
    devices: Sequence[jax.Device],
    state_bytes: int,
    raw: dict[str, Any],
    figs: Sequence[_figure.Figure],
) -> dict[str, Any]:
    """What `--json` writes: the device, the raw timings and the figures."""
    return {
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "platform": devices[0].platform,
        "state_bytes": state_bytes,
        "raw": raw,
        "figures": [
            {
                **{k: getattr(f, k) for k in ("id", "name", "value", "unit", "baseline")},
                "baseline_name": f.baseline_name,
                "ratio": f.ratio,
                "target": f.target,
                "met": f.met,
            }
            for f in figs
        ],
    }


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _measure(
    training: _state.Training,
    memory_root: Path,
    work: Path,
    cfg: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    shards = _state.own_shards(training.state(0))
    pinned = [
        jax.sharding.SingleDeviceSharding(next(iter(s.devices())), memory_kind="pinned_host")
        for s in shards
    ]
    floor = [
        _timed(lambda: jax.block_until_ready(jax.device_put(shards, pinned))) for _ in range(4)
    ]
    raw["pinned_floor_first_s"] = floor[0]
    raw["pinned_floor_s"] = _median(floor[1:])
    raw.update(_host_to_device(shards, pinned))

    # Isolated saves: how long mngr.save() blocks (the commit runs on after it).
    ours = _managers.Jaxckpt(work / "jaxckpt", memory_root, cfg, persist_every=10**9)
    theirs = _managers.orbax_manager(work / "orbax", cfg, max_to_keep=2)
    blocks: dict[str, list[float]] = {"jaxckpt": [], "orbax": []}
    for step in range(1, args.saves + 1):
        state = training.state(step)
        blocks["jaxckpt"].append(_timed(lambda: ours.save(step, state)))  # noqa: B023
        ours.mngr.wait_until_finished()
        blocks["orbax"].append(
            _timed(lambda: theirs.save(step, args=ocp.args.StandardSave(state)))  # noqa: B023
        )
        theirs.wait_until_finished()
    raw["jaxckpt_save_block_all_s"] = blocks["jaxckpt"]
    raw["orbax_save_block_all_s"] = blocks["orbax"]
    raw["jaxckpt_save_block_s"] = _median(blocks["jaxckpt"][1:] or blocks["jaxckpt"])
    raw["orbax_save_block_s"] = _median(blocks["orbax"][1:] or blocks["orbax"])
    raw["jaxckpt_host_staging"] = ours.metrics("save")[-1].get("host_staging")

    # Restores of the latest step, each checked bitwise against the saved state.
    last, expected = args.saves, training.state(args.saves)
    target = {**training.abstract(), "step": last}
    restore_args = ocp.args.Composite(train=jaxckpt.TieredRestore(target))
    times: dict[str, list[float]] = {"jaxckpt": [], "orbax": []}
    bitwise = True
    for _ in range(3):
        start = time.perf_counter()
        mine = jax.block_until_ready(ours.mngr.restore(last, args=restore_args).train)
        times["jaxckpt"].append(time.perf_counter() - start)
        start = time.perf_counter()
        other = jax.block_until_ready(theirs.restore(last, args=ocp.args.StandardRestore(target)))
        times["orbax"].append(time.perf_counter() - start)
        bitwise &= _equal(mine, expected) and _equal(other, expected)
    raw["jaxckpt_restore_s"] = _median(times["jaxckpt"])
    raw["orbax_restore_s"] = _median(times["orbax"])
    raw["restore_tier"] = ours.handler.last_restore_metrics.get("tier")
    raw["bitwise_equal"] = bitwise

    # Training loops: no saves, then jaxckpt and Orbax saving every `save_every` steps.
    def loop(save: Callable[[int], None] | None, first: int) -> float:
        training.train_step()  # warm
        start = time.perf_counter()
        for step in range(first, first + args.loop_steps):
            training.train_step()
            if save is not None and step % args.save_every == 0:
                save(step)
        return (time.perf_counter() - start) / args.loop_steps

    base = 1000
    raw["no_save_step_s"] = loop(None, base)
    raw["jaxckpt_loop_step_s"] = loop(lambda s: ours.save(s, training.state(s)), base)
    ours.mngr.wait_until_finished()
    raw["orbax_loop_step_s"] = loop(
        lambda s: theirs.save(s, args=ocp.args.StandardSave(training.state(s))), 2 * base
    )
    theirs.wait_until_finished()
    ours.close()
    theirs.close()
    return raw


def _host_to_device(shards: Sequence[jax.Array], pinned: Sequence[Any]) -> dict[str, Any]:
    """The restore's last step, two ways: host buffers (pageable, as a restore maps them
    from the memory tier) put on their devices directly, and through `pinned_host`
    memory first (a host copy into the pinned pool, then DMA); the first of these also
    finds the pool cold, as a restore after a restart does."""
    host = [np.array(s, copy=True) for s in shards]  # own buffers, not views of the devices
    devices = [jax.sharding.SingleDeviceSharding(next(iter(s.devices()))) for s in shards]

    def via_pinned() -> Any:
        return jax.device_put(jax.device_put(host, pinned), devices)

    direct = [
        _timed(lambda: jax.block_until_ready(jax.device_put(host, devices))) for _ in range(3)
    ]
    staged = [_timed(lambda: jax.block_until_ready(via_pinned())) for _ in range(3)]
    return {
        "h2d_direct_s": _median(direct),
        "h2d_via_pinned_first_s": staged[0],
        "h2d_via_pinned_s": _median(staged[1:]),
    }


def _equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


if __name__ == "__main__":
    sys.exit(main())
