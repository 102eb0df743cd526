"""Runs a scenario of `mp_worker.py` in N JAX processes on loopback (one "host" each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import patience
import portpicker

from jaxckpt.launch._supervise import port_in_use

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKERS = REPO / "tests" / "workers"  # the scenario scripts


@dataclass
class ProcessResult:
    returncode: int
    result: dict[str, Any] | None
    output: str


def run(
    scenario: str,
    roots: list[str],
    domains: list[str],
    args: dict[str, Any],
    *,
    timeout: float = 240,
    env: dict[int, dict[str, str]] | None = None,
    expect_ok: bool = True,
    worker: str = "mp_worker.py",
    prefix: dict[int, list[str]] | None = None,
) -> list[ProcessResult]:
    """Starts len(roots) processes; process i uses memory root roots[i] in failure domain domains[i].

    `worker` is the scenario script in tests/ (it defines `scenario_<name>` functions);
    `prefix[i]` goes before process i's command (`ip netns exec NAME`: tests/support/netns.py).

    Returns each process's parsed `RESULT` line. With `expect_ok`, any process
    exiting non-zero fails the caller with every process's output.
    """
    for attempt in range(3):
        results = _run_once(worker, scenario, roots, domains, args, timeout, env or {}, prefix)
        if not any(port_in_use(r.output) for r in results):
            break
        time.sleep(0.5 + attempt)
    # A scenario that ends in a simulated crash (`"crash": True`, os._exit after its RESULT
    # line) may be aborted by JAX's coordinator once a peer has gone: its RESULT stands.
    crash = bool(args.get("crash"))
    if expect_ok and any((r.returncode != 0 and not crash) or r.result is None for r in results):
        dump = "\n".join(
            f"--- process {i} rc={r.returncode}\n{r.output[-6000:]}" for i, r in enumerate(results)
        )
        raise AssertionError(f"scenario {scenario} failed:\n{dump}")
    return results


def _run_once(worker, scenario, roots, domains, args, timeout, env, prefix) -> list[ProcessResult]:
    n = len(roots)
    port = portpicker.pick_unused_port()
    procs = []
    for i in range(n):
        proc_env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": f"{REPO}:{HERE}:{WORKERS}",
            "MP_COORDINATOR": f"127.0.0.1:{port}",
            "MP_NUM_PROCESSES": str(n),
            "MP_PROCESS_ID": str(i),
            "JAXCKPT_FAILURE_DOMAIN": domains[i],
            "MP_MEMORY_ROOT": roots[i],
            **env.get(i, {}),
        }
        procs.append(
            subprocess.Popen(
                [
                    *(prefix or {}).get(i, []),
                    sys.executable,
                    str(WORKERS / worker),
                    scenario,
                    json.dumps(args),
                ],
                env=proc_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    collected, timed_out = patience.communicate(procs, timeout)
    outputs = [out + ("\n[multiproc] TIMEOUT: killed" if timed_out else "") for out, _ in collected]
    results = []
    for p, out in zip(procs, outputs, strict=True):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(
            ProcessResult(p.returncode, json.loads(lines[-1][7:]) if lines else None, out)
        )
    return results
