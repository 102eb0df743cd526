"""How many spare slabs a memory tier keeps within `TierOptions.memory_budget`. Pure logic.

A tier holds its kept steps (each process's own part and the replicas it holds for
peers) and, for the next saves to refill at memory speed, the slabs of retired steps
(`MemoryTier.recycle`). The budget caps the sum: a retired slab is kept as a spare only
while the steps, the spares already kept and it fit in the budget. Without a budget a
tier keeps as many spares as the newest step has parts. The kept steps themselves are
never dropped for the budget: `memory_keep` decides those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SpareDecision:
    """Whether a retired slab is kept as a spare, and what the tier holds then."""

    keep: bool
    spares: int  # spare slabs after the decision
    spare_bytes: int  # their bytes
    step_bytes: int  # the kept steps' slabs
    budget: int | None
    over_budget: bool  # declined for the budget (not for the count)

    def describe(self) -> str:
        """One log line: what the budget chose, and why."""
        text = (
            f"keeping {self.spares} spare slab(s) ({_gib(self.spare_bytes)}) beside "
            f"{_gib(self.step_bytes)} of kept steps"
        )
        if self.budget is None:
            return text
        text = f"memory budget {_gib(self.budget)}: {text}"
        if self.over_budget:
            text += (
                "; no room for more, so the next saves write fresh tmpfs pages (slower): "
                "a budget of (memory_keep + 1) x the step's bytes keeps a spare for every part"
            )
        return text


def decide(
    budget: int | None,
    step_bytes: int,
    spare_sizes: Sequence[int],
    size: int,
    max_spares: int,
) -> SpareDecision:
    """Whether a retired slab of `size` bytes becomes a spare.

    Args:
      budget: `TierOptions.memory_budget` (bytes), or None for no budget.
      step_bytes: the bytes of the slabs of the steps the tier keeps.
      spare_sizes: the sizes of the spare slabs it holds already.
      size: the retired slab's size.
      max_spares: at most this many spares (the newest step's parts).
    """
    held = sum(spare_sizes)
    fits_count = len(spare_sizes) < max_spares
    fits_budget = budget is None or step_bytes + held + size <= budget
    keep = fits_count and fits_budget
    return SpareDecision(
        keep,
        len(spare_sizes) + keep,
        held + size * keep,
        step_bytes,
        budget,
        over_budget=fits_count and not fits_budget,
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"
