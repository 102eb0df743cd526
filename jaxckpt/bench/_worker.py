"""One process of `jaxckpt bench`: trains, saves and restores, and reports raw timings.

Started by `jaxckpt.bench` once per process (`python -m jaxckpt.bench._worker
CONFIG_JSON`), with its process id, coordinator and memory root in the
environment. Every process runs the same phases in lockstep; every wait on
another process is bounded by the configured timeout. The last stdout line is
`BENCH_RESULT <json>`; `jaxckpt.bench` turns the results into figures.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Final

RESULT_PREFIX: Final = "BENCH_RESULT "
ENV_PROCESS_ID: Final = "JAXCKPT_BENCH_PROCESS_ID"
ENV_COORDINATOR: Final = "JAXCKPT_BENCH_COORDINATOR"
ENV_MEMORY_ROOT: Final = "JAXCKPT_BENCH_MEMORY_ROOT"
# The accelerator-host proxy's XLA: one thread computes the step (`_proxy`).
PROXY_XLA_FLAGS: Final = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

log = logging.getLogger("jaxckpt.bench")


def _start_jax(cfg: dict[str, Any]) -> None:
    import jax

    if cfg["platform"] == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cfg["devices_per_process"])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg["processes"] > 1:
        address = os.environ[ENV_COORDINATOR]
        jax.distributed.initialize(
            coordinator_address=address,
            coordinator_bind_address=address,
            num_processes=cfg["processes"],
            process_id=int(os.environ[ENV_PROCESS_ID]),
            heartbeat_timeout_seconds=10,
            initialization_timeout=int(cfg["timeout_s"]),
        )
    jax.devices()  # every process must touch the backend: the others wait on its device topology


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _start_jax(cfg)
    if cfg.get("layout") == "hsdp":
        from jaxckpt.bench import _hsdp

        result = _hsdp.run(cfg, Path(os.environ[ENV_MEMORY_ROOT]))
    elif cfg.get("layout") == "reshard":
        from jaxckpt.bench import _reshard_phases

        result = _reshard_phases.run(cfg, Path(os.environ[ENV_MEMORY_ROOT]))
    else:
        from jaxckpt.bench import _phases

        result = _phases.run(cfg, Path(os.environ[ENV_MEMORY_ROOT]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
