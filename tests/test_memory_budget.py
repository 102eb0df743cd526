"""`TierOptions.memory_budget`: validated on construction; decides the spare slabs a
memory tier keeps, and says what it chose (no jax, no processes)."""

from __future__ import annotations

import logging

import pytest
from test_memory_tier import commit_step

import jaxckpt
from jaxckpt.memory import _memory_budget
from jaxckpt.memory._memory_tier import MemoryTier


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"memory_budget": 0}, r"TierOptions.memory_budget must be an integer >= 1, got 0"),
        ({"memory_budget": "8GiB"}, r"TierOptions.memory_budget must be an integer >= 1"),
        ({"memory_budget": True}, r"TierOptions.memory_budget must be an integer"),
        ({"memory_budget": 2.5e9}, r"TierOptions.memory_budget must be an integer"),
        (
            {"memory_budget": 1 << 30, "spare_slabs": False},
            r"memory_budget decides how many spare slabs .* spare_slabs=False",
        ),
    ],
)
def test_the_budget_is_validated_on_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        jaxckpt.TierOptions("/dev/shm/x", **kw)
    assert jaxckpt.TierOptions("/dev/shm/x", memory_budget=1 << 30).memory_budget == 1 << 30


def test_the_decision():
    decide = _memory_budget.decide
    # No budget: a spare for every part of the newest step.
    assert decide(None, 100, [10], 10, max_spares=2).keep
    assert not decide(None, 100, [10, 10], 10, max_spares=2).keep
    # A budget: steps + spares + this one must fit.
    fits = decide(130, 100, [10], 20, max_spares=2)
    assert fits.keep and fits.spares == 2 and fits.spare_bytes == 30 and not fits.over_budget
    tight = decide(129, 100, [10], 20, max_spares=2)
    assert not tight.keep and tight.spares == 1 and tight.over_budget
    assert "no room for more" in tight.describe() and "memory budget" in tight.describe()
    # Declined for the count, not for the budget: nothing to warn about.
    assert not decide(10**9, 100, [10, 10], 10, max_spares=2).over_budget


def _spares(tier: MemoryTier) -> int:
    return sum(1 for _ in (tier.run_dir / ".free").iterdir())


def _three_steps(tier: MemoryTier, size: int) -> None:
    tier.prepare("ckpt", 0)
    for step in (1, 2, 3):
        commit_step(tier, step, owner=0, size=size)
        commit_step(tier, step, owner=1, size=size)


@pytest.mark.parametrize(
    "budget,spares",
    [(None, 2), (4 * 4096, 2), (4 * 4096 - 1, 1), (3 * 4096, 1), (2 * 4096, 0), (1, 0)],
)
def test_the_budget_decides_the_spare_slabs(tmp_path, budget, spares):
    """Two parts of 4 KiB a step, one step kept: the kept step holds 8 KiB; each spare
    takes 4 KiB more, as far as the budget goes (the kept step is never dropped)."""
    tier = MemoryTier(str(tmp_path), "run-a", memory_budget=budget)
    _three_steps(tier, 4096)
    assert tier.retain(1, upto=3) == [1, 2]
    assert _spares(tier) == spares
    assert tier.inventory() == {3: [0, 1]}
    # A save then takes the spares there are; once they are gone it writes a new slab.
    for _ in range(spares):
        assert tier.take_free_slab(tmp_path / f"taken-{_}", 4096)
    assert not tier.take_free_slab(tmp_path / "none", 4096)


def test_the_budget_says_what_it_chose_once_per_change(tmp_path, caplog):
    tier = MemoryTier(str(tmp_path), "run-a", memory_budget=3 * 4096)
    _three_steps(tier, 4096)
    with caplog.at_level(logging.INFO):
        tier.retain(1, upto=3)
        for step in (4, 5):  # the same decision again: said once
            commit_step(tier, step, owner=0, size=4096)
            commit_step(tier, step, owner=1, size=4096)
            tier.take_free_slab(tmp_path / f"taken-{step}", 4096)
            tier.retain(1, upto=step)
    said = [r for r in caplog.records if "memory budget" in r.getMessage()]
    messages = [r.getMessage() for r in said]
    assert len(said) == 2, messages  # one spare kept, no room for the second: said once each
    assert "keeping 1 spare slab(s)" in messages[0] and said[0].levelno == logging.INFO
    assert "no room for more" in messages[1] and said[1].levelno == logging.WARNING
    assert all(str(tier.run_dir) in m for m in messages)
