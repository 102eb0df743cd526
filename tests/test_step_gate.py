"""When a persisted part enters its step directory (`persistent/_step_gate`): at once while
no newer save has begun, else at the next moment the manager deletes nothing."""

from __future__ import annotations

from jaxckpt.persistent import _step_gate


def test_a_part_enters_at_once_until_a_newer_save_begins(tmp_path):
    placed: list[int] = []
    root = tmp_path / "a"
    assert _step_gate.enter(root, 5, lambda: placed.append(5))  # no save began here yet
    _step_gate.begin(root, 5)
    assert _step_gate.enter(root, 5, lambda: placed.append(50))  # its own save began only
    _step_gate.begin(root, 6)
    assert not _step_gate.enter(root, 5, lambda: placed.append(51))
    assert placed == [5, 50]
    assert 5 in _step_gate.waiting_steps()
    _step_gate.begin(root, 7)  # a save's beginning places nothing: its commit settles
    assert placed == [5, 50]
    assert _step_gate.settle(root)
    assert placed == [5, 50, 51]
    assert 5 not in _step_gate.waiting_steps()


def test_settle_places_what_waits_and_says_so(tmp_path):
    placed: list[int] = []
    root = tmp_path / "b"
    _step_gate.begin(root, 9)
    assert not _step_gate.enter(root, 8, lambda: placed.append(8))
    assert _step_gate.settle(root)
    assert placed == [8]
    assert not _step_gate.settle(root)  # nothing waits any more


def test_directories_wait_apart_and_a_failed_placement_spares_the_rest(tmp_path):
    placed: list[str] = []
    a, b = tmp_path / "c", tmp_path / "d"
    _step_gate.begin(a, 3)
    _step_gate.begin(b, 1)
    assert not _step_gate.enter(a, 2, lambda: placed.append("a2"))
    assert _step_gate.enter(b, 2, lambda: placed.append("b2"))  # b's newest save is older

    def broken() -> None:
        raise OSError("disk gone")

    assert not _step_gate.enter(a, 1, broken)
    assert not _step_gate.enter(a, 2, lambda: placed.append("a2'"))
    assert _step_gate.settle(a)  # logs the failure, places the others
    assert placed == ["b2", "a2", "a2'"]
