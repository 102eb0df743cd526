"""`jaxckpt bench --scale`: its command line, and what it prints (`_scale` simulates).

Unless `--relay-latency-us` is given, a relay store's time a call is measured
first, in the same run: a real peer data service on loopback, its relay store
set and read by `RelayClient` (`relay_call_s`), the median of a set and a get.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from jaxckpt.bench import _coordinator, _scale
from jaxckpt.peer import _relay_client, _server

RELAY_CALLS: Final = 200  # set-and-get pairs timed to measure a relay call


def relay_call_s(pairs: int = RELAY_CALLS) -> float:
    """The median time of one relay store call over the peer data service on loopback
    (a member's set of its value and blocking get of a value already set, each timed)."""
    token, run_id = "0" * 64, "run-relay-cost"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / run_id).mkdir()
        server = _server.PeerServer(Path(tmp), run_id=run_id, token=token, host="127.0.0.1")
        server.start()
        try:
            client = _relay_client.RelayClient(
                server.address, token=token, run_id=run_id, timeout=10.0
            )
            times = []
            for i in range(pairs):
                key = f"jaxckpt/cost/{i}"
                started = time.perf_counter()
                client.key_value_set(f"{key}/v/1", "x" * 256)
                times.append(time.perf_counter() - started)
                server.relay_store.key_value_set(f"{key}/all", "ok:" + "y" * 64)
                started = time.perf_counter()
                client.blocking_key_value_get(f"{key}/all", 10_000)
                times.append(time.perf_counter() - started)
            return statistics.median(times)
        finally:
            server.close()


def growth(counts: Sequence[int], values: Sequence[float]) -> str:
    """The model among 1, N, N log N and N^2 that fits `values` best (least squares of the
    log ratio), or "-" with fewer than three points."""
    points = [(n, v) for n, v in zip(counts, values, strict=True) if v > 0]
    if len(points) < 3:
        return "-"
    models: dict[str, Callable[[int], float]] = {
        "1": lambda n: 1.0,
        "N": float,
        "N log N": lambda n: n * math.log2(n),
        "N^2": lambda n: float(n * n),
    }
    best, best_err = "-", math.inf
    for name, f in models.items():
        logs = [math.log(v / f(n)) for n, v in points]
        mean = sum(logs) / len(logs)
        err = sum((x - mean) ** 2 for x in logs)
        if err < best_err:
            best, best_err = name, err
    return best


def table(rows: list[dict[str, Any]]) -> str:
    head = ("op", "N", "rpcs", "coord. bytes", "bytes/process", "modeled", "CPU/proc", "peak/proc")
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["op"],
                str(r["processes"]),
                str(r["rpcs"]),
                _bytes(r["coordinator_bytes"]),
                _bytes(r["coordinator_bytes"] / r["processes"]),
                f"{r['modeled_s'] * 1000:.1f} ms",
                f"{r['plan_cpu_s'] * 1000:.2f} ms",
                _bytes(r["peak_rss_bytes"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def growth_table(rows: list[dict[str, Any]]) -> str:
    lines = ["growth in N: " + ", ".join(_scale.FIGURES)]
    for op in _scale.OPS:
        mine = [r for r in rows if r["op"] == op]
        counts = [r["processes"] for r in mine]
        fits = [growth(counts, [r[f] for r in mine]) for f in _scale.FIGURES]
        lines.append(
            f"  {op}: " + ", ".join(f"{f} {g}" for f, g in zip(_scale.FIGURES, fits, strict=True))
        )
    return "\n".join(lines)


def where_time_goes(rows: list[dict[str, Any]]) -> str:
    """Where each operation's modeled time goes: the coordinator's queue (its calls, then
    its bytes), the relay groups' calls (each group's store a queue of its own, beside
    the coordinator's), and for a restore when every process had its plan."""
    lines = ["where the modeled time goes (the coordinator's queue; calls never overlap):"]
    for r in rows:
        n = r["processes"]
        line = (
            f"  {r['op']} at {n}: {r['rpcs']} calls ({r['process_rpcs']} a process, "
            f"{r['max_process_rpcs']} the decider) = {r['queue_calls_s'] * 1000:.0f} ms, "
            f"{_bytes(r['coordinator_bytes'])} = {r['queue_bytes_s'] * 1000:.0f} ms"
        )
        if r.get("groups"):
            line += (
                f"; relay: {r['relay_rpcs']} calls, {_bytes(r['relay_bytes'])} in "
                f"{r['groups']} groups' stores (about {r['relay_rpcs'] / r['groups']:.0f} "
                f"calls a group, queued per group), at most {r['relay_max_keys']} keys left "
                "in one"
            )
        if "planned_s" in r:
            line += f"; every process planned by {r['planned_s'] * 1000:.0f} ms"
        if "index_bytes" in r:
            line += (
                f"; each process read {_bytes(r['index_bytes'])} of the step index in "
                f"{r['index_cpu_s'] * 1000:.1f} ms CPU (included in its CPU)"
            )
        lines.append(
            line + f"; CPU {r['plan_cpu_s'] * 1000:.0f} ms the decider, "
            f"{r['process_cpu_s'] * 1000:.0f} ms another process; modeled "
            f"{r['modeled_s'] * 1000:.0f} ms"
        )
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxckpt bench --scale", description=__doc__)
    parser.add_argument("--scale", action="store_true", help="this mode")
    parser.add_argument(
        "--processes-list",
        default=",".join(map(str, _scale.DEFAULT_PROCESSES)),
        help="process counts to simulate (default %(default)s)",
    )
    parser.add_argument(
        "--ops", default=",".join(_scale.OPS), help="operations (default %(default)s)"
    )
    parser.add_argument(
        "--latency-us", type=float, default=_coordinator.LATENCY_S * 1e6, help="per call"
    )
    parser.add_argument(
        "--bandwidth-gbps", type=float, default=_coordinator.BANDWIDTH / 1e9, help="GB/s"
    )
    parser.add_argument(
        "--relay-latency-us",
        type=float,
        default=None,
        help="a relay store's time a call (default: measured here first, see relay_call_s)",
    )
    parser.add_argument(
        "--relay-group",
        type=int,
        default=None,
        help="the most processes a relay group has (default: about sqrt(N / 20), at most 32)",
    )
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="saves and restores straight through the coordinator (no relay groups)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every row here")
    return parser


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(n) for n in args.processes_list.split(",")})
    except ValueError:
        parser.error(f"--processes-list takes counts like 8,64, got {args.processes_list!r}")
    ops = [op for op in args.ops.split(",") if op]
    if any(n < 2 for n in counts) or not set(ops) <= set(_scale.OPS):
        parser.error(f"counts must be >= 2 and ops among {', '.join(_scale.OPS)}")
    if args.relay_latency_us is None and not args.no_relay:
        args.relay_latency_us = round(relay_call_s() * 1e6, 1)
        print(
            f"relay store call measured here: {args.relay_latency_us:g} us (median of "
            f"{RELAY_CALLS} sets and as many gets over the peer data service on loopback)",
            file=sys.stderr,
            flush=True,
        )
    rows = []
    started = time.monotonic()
    for n in counts:
        for op in ops:
            row = _scale.measure(
                n,
                op,
                args.latency_us / 1e6,
                args.bandwidth_gbps * 1e9,
                relay=not args.no_relay,
                relay_group=args.relay_group,
                relay_latency_s=(args.relay_latency_us or 0.0) / 1e6,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(table(rows))
    print()
    print(growth_table(rows))
    print()
    print(where_time_goes(rows))
    print(
        f"\nsimulated in {time.monotonic() - started:.0f} s; coordinator: "
        f"{args.latency_us:g} us a call, {args.bandwidth_gbps:g} GB/s; "
        + ("no relay" if args.no_relay else f"relay stores: {args.relay_latency_us:g} us a call"),
        file=sys.stderr,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "latency_us": args.latency_us,
                    "relay_latency_us": None if args.no_relay else args.relay_latency_us,
                },
                f,
                indent=1,
            )
    return 0
