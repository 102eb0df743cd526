"""The mean time between failures M, from a failure log of timestamps (`--failure-log`)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable


def parse_timestamp(text: str) -> float:
    """Epoch seconds from epoch seconds or an ISO 8601 time (naive times are UTC).

    Raises:
      ValueError: if `text` is neither.
    """
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither epoch seconds nor an ISO 8601 time (2026-01-31T12:00:00Z)."
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    return t.timestamp()


def mtbf_from_log(lines: Iterable[str]) -> tuple[float, int, float]:
    """The MTBF from a failure log: one timestamp per line (blank and # lines skipped).

    n failures span n - 1 intervals between failures, so MTBF = span / (n - 1).

    Returns:
      (mtbf_s, failures, span_s).

    Raises:
      ValueError: on an unreadable line (naming it) or fewer than two failures.
    """
    times = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            times.append(parse_timestamp(line))
        except ValueError as e:
            raise ValueError(f"Failure log line {number}: {e}") from None
    if len(times) < 2:
        raise ValueError(
            f"A failure log needs at least two timestamps to give an MTBF, got {len(times)}; "
            "pass --mtbf-hours instead."
        )
    span = max(times) - min(times)
    if span <= 0:
        raise ValueError("Every timestamp in the failure log is the same; cannot tell an MTBF.")
    return span / (len(times) - 1), len(times), span
