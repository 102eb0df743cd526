"""The Young/Daly model: the checkpoint interval that loses the least time to failures.

With a save cost C (seconds of training lost per checkpoint), a restore time R
and a mean time between failures M, checkpointing every tau seconds of work
loses, to first order, the fraction

    W(tau) = C / tau + (tau / 2 + R) / M

of the time: C per interval, and per failure half an interval of recomputed
work plus the restore. Young (1974) minimises it at tau = sqrt(2 C M); Daly
(2006) adds the higher-order terms,

    tau = sqrt(2 C M) * [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C    if C < 2M
    tau = M                                                           otherwise.
"""

from __future__ import annotations

import math


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 C M), in seconds of work between checkpoints."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (seconds of work between checkpoints)."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def waste_fraction(interval_s: float, cost_s: float, restore_s: float, mtbf_s: float) -> float:
    """The first-order fraction of time lost, C/tau + (tau/2 + R)/M."""
    _check(cost_s, mtbf_s)
    if interval_s <= 0:
        return math.inf if cost_s > 0 else restore_s / mtbf_s
    return cost_s / interval_s + (interval_s / 2 + restore_s) / mtbf_s


def _check(cost_s: float, mtbf_s: float) -> None:
    if not mtbf_s > 0:
        raise ValueError(f"The MTBF must be a positive number of seconds, got {mtbf_s!r}.")
    if not cost_s >= 0:
        raise ValueError(f"The checkpoint cost must be >= 0 seconds, got {cost_s!r}.")
