"""The memory tier: one directory per run on a host-local tmpfs.

Layout under `<memory_root>/<run_id>/`:

    RUN.json                      who this run is (checkpoint directory, created)
    step_<step>/part_<owner>/     committed parts (own and replicas held for peers):
                                  manifest.json and one slab file (`_slab`)
    step_<step>/.pin-<maker>-<id> pins: the step is in use by a live process (a held lock)
    .staging/<maker>-<what>-<id>  parts being written, steps being removed; never read;
                                  `<maker>` records the process (`_liveness.owned_name`)
    step_<step>/part_<owner>/.lent  the slab was lent to a restore: never reused
    .free/slab-<id>               slabs of retired steps, for the next saves to reuse

A part becomes visible only by `os.rename` of a complete staging directory, so
a crash at any moment leaves the previous content or the new one. Retiring a
step moves its slabs to `.free/` (at most as many as the newest step holds, so
the tier holds about one step more than it keeps) instead of freeing their
pages: the next save fills one at memory speed (`take_free_slab`). A slab lent to a
restore (`lend`) is only ever unlinked: arrays restored from it keep its pages.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from absl import logging as log

from jaxckpt.coord import _liveness
from jaxckpt.format import _chunking, _finite, _format
from jaxckpt.memory import _fs, _memory_budget, _quarantine, _slab

_STEP_RE = re.compile(r"^step_(\d+)$")
_PART_RE = re.compile(r"^part_(\d+)$")
_RECYCLED_HINTS = 8  # slabs this process retired that `take_free_slab` tries first

# In a part directory: its slab was lent to a restore (`MemoryTier.lend`).
LENT_MARKER = ".lent"
# A pin on a step; `release()` removes it. Judged live by its lock, not by a pid.
Pin = _liveness.HeldFile


class MemoryTier:
    """This host's memory tier for one run."""

    def __init__(
        self,
        memory_root: str,
        run_id: str,
        spare_slabs: bool = True,
        memory_budget: int | None = None,
    ):
        self.run_dir = Path(memory_root) / run_id
        self.run_id = run_id
        self.spare_slabs = spare_slabs  # False: `recycle` keeps none (TierOptions.spare_slabs)
        # Why `prepare` could not write the tier (read-only, full, not a directory);
        # None once it could. Restores skip such a tier, saves are refused.
        self.unwritable: OSError | None = None
        self._run: tuple[str, int, str] = ("", 0, "")
        self.memory_budget = memory_budget  # caps steps + spares (TierOptions.memory_budget)
        self._told: set[tuple[int, bool]] = set()  # the budget's decisions logged
        # The slabs this process put into `.free/` last (`recycle`), newest last: the
        # next save tries them before it lists `.free/` (`take_free_slab`).
        self._recycled: collections.deque[Path] = collections.deque(maxlen=_RECYCLED_HINTS)

    def prepare(self, checkpoint_dir: str, process_index: int, failure_domain: str = "") -> None:
        """Creates the run directory, checks that it is writable, records the run.

        RUN.json records the checkpoint directory and the failure domain of the
        processes using this memory root (the operator tools read it). Every
        process sharing a memory root is on one host, so in one failure domain;
        one that declares another is logged, since replicas placed "in another
        domain" could then share this host.

        A tier that cannot be written (a read-only or full filesystem, a path
        that is no directory) is no error here: a replacement host must still
        restore from peers and persistent storage. It is logged once and marked
        `unwritable`: restores offer nothing from it (`_restore.memory_parts`:
        a step that cannot be pinned must not be read in place), and
        `require_writable` refuses saves.
        """
        self._run = (checkpoint_dir, process_index, failure_domain)
        try:
            self._record_run()
        except OSError as e:
            self.unwritable = e
            log.warning(
                "jaxckpt: [process %d] the memory tier %s cannot be written (%s): restores "
                "skip it and read from peers and persistent storage; saves are refused until "
                "it can be written (point TierOptions.memory_root at a writable tmpfs with "
                "free space).",
                process_index,
                self.run_dir,
                e,
            )
        else:
            self.unwritable = None

    def require_writable(self, step: int) -> None:
        """Raises if `prepare` found the tier unwritable and it still is (tried again:
        space may have been freed, a filesystem remounted).

        Raises:
          OSError: ENOSPC if the tier's filesystem is full, saying what to do.
          PermissionError: if it cannot be written otherwise, naming it.
        """
        if self.unwritable is None:
            return
        try:
            self._record_run()
        except OSError as e:
            self.unwritable = e
        else:
            self.unwritable = None
            return
        process_index = self._run[1]
        what = f"[process {process_index}] The memory tier {self.run_dir}"
        if _fs.is_out_of_space(self.unwritable):
            raise _fs.out_of_space(
                self.unwritable,
                f"{what} is full, so step {step} cannot be saved",
                "Give TierOptions.memory_root's filesystem more room (a tmpfs: its size= "
                "mount option), keep fewer steps there (TierOptions.memory_keep), or point "
                "TierOptions.memory_root at another tmpfs.",
            ) from self.unwritable
        raise PermissionError(
            f"{what} is not writable ({self.unwritable}), so step {step} cannot be saved. "
            "Point TierOptions.memory_root at a writable tmpfs directory such as "
            "/dev/shm/jaxckpt."
        ) from self.unwritable

    def _record_run(self) -> None:
        """Creates the run directory, writes a probe, writes RUN.json if missing."""
        checkpoint_dir, process_index, failure_domain = self._run
        (self.run_dir / ".staging").mkdir(parents=True, exist_ok=True)
        probe = self.run_dir / ".staging" / _liveness.owned_name("probe")
        probe.write_bytes(b"")
        probe.unlink()
        run_file = self.run_dir / "RUN.json"
        if not run_file.exists():
            run = {
                "run_id": self.run_id,
                "checkpoint_dir": checkpoint_dir,
                "created": time.time(),
            }
            if failure_domain:
                run["failure_domain"] = failure_domain
            _fs.write_atomic(run_file, json.dumps(run))
        elif failure_domain:
            self._check_domain(run_file, failure_domain, process_index)

    def _check_domain(self, run_file: Path, failure_domain: str, process_index: int) -> None:
        try:
            recorded = json.loads(run_file.read_text()).get("failure_domain")
        except (OSError, ValueError, AttributeError):
            return
        if recorded is not None and recorded != failure_domain:
            log.warning(
                "jaxckpt: [process %d] the memory tier %s is used by processes of failure "
                "domain %r, but this process declares %r; processes sharing a memory root "
                "share a host, so set one TierOptions.failure_domain (or "
                "JAXCKPT_FAILURE_DOMAIN) for all of them.",
                process_index,
                self.run_dir,
                recorded,
                failure_domain,
            )

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step:012d}"

    def step_dir(self, step: int) -> Path:
        return self.run_dir / self.step_name(step)

    def part_dir(self, step: int, owner: int) -> Path:
        return self.step_dir(step) / _format.part_dir_name(owner)

    def new_staging_dir(self, step: int, owner: int) -> Path:
        path = self.run_dir / ".staging" / _liveness.owned_name(f"step_{step}.part_{owner}")
        path.mkdir(parents=True)
        return path

    def stage_slab(
        self,
        step: int,
        owner: int,
        chunks: Sequence[np.ndarray],
        checksum: bool = True,
        tally: _finite.Tally | None = None,
        tiles: Sequence[Sequence[_chunking.Region] | None] | None = None,
    ) -> StagedSlab:
        """A new staging directory for part (step, owner) whose slab holds `chunks`
        (in a retired slab if there is one: `take_free_slab`), with their CRC-32Cs
        if `checksum` (else `_slab.checksums` computes them later, in place) and
        their NaN/Inf counted into `tally` in the same pass; `tiles[i]`: the tiles of
        chunk i (`_slab.write`).

        Raises:
          OSError: if the slab cannot be written (the staging directory is removed);
            when the tier is full, one that says what to do.
        """
        start = time.perf_counter()
        staging = self.new_staging_dir(step, owner)
        try:
            slab = staging / _slab.SLAB_FILE
            offsets, size = _slab.layout([c.nbytes for c in chunks])
            self.take_free_slab(slab, size)
            crcs = _slab.write(
                slab, chunks, offsets, size, checksum=checksum, tally=tally, tiles=tiles
            )
        except BaseException as e:
            # The slab's writes are done when `_slab.write` returns or raises.
            _fs.remove_entry(staging)
            if _fs.is_out_of_space(e):
                raise self.full_error(e, step, owner) from e
            raise
        return StagedSlab(staging, offsets, crcs if checksum else None, time.perf_counter() - start)

    def full_error(self, error: BaseException, step: int, owner: int) -> OSError:
        """The out-of-space `error` of a write of part (step, owner), saying what to do."""
        return _fs.out_of_space(
            error,
            f"[process {owner}] Step {step} does not fit in the memory tier {self.run_dir}",
            "Give TierOptions.memory_root's filesystem more room (a tmpfs: its size= "
            "mount option) or keep fewer steps there (TierOptions.memory_keep).",
        )

    def take_free_slab(self, dest: Path, nbytes: int = 0) -> bool:
        """Moves a retired step's slab to `dest`, if there is one: the one this process
        retired last if it holds `nbytes` (no listing), else the smallest of at least
        `nbytes` (its pages are all reused), else the largest.

        Any process sharing the memory root may take the same one: `os.rename`
        gives it to exactly one of them.
        """
        while True:  # the slabs this process retired last, unless another took them
            try:
                hint = self._recycled.pop()
            except IndexError:
                break
            with contextlib.suppress(OSError):
                if hint.stat().st_size >= nbytes:
                    os.rename(hint, dest)
                    return True
        free = self.run_dir / ".free"
        try:
            sized = []
            for p in free.iterdir():
                with contextlib.suppress(OSError):  # taken meanwhile
                    sized.append((p.stat().st_size, p))
        except OSError:
            return False
        fits = sorted(s for s in sized if s[0] >= nbytes)
        short = sorted((s for s in sized if s[0] < nbytes), reverse=True)
        candidates = [p for _, p in fits + short]
        for slab in candidates:
            try:
                os.rename(slab, dest)
                return True
            except OSError:
                continue
        return False

    def lend(self, step: int, owner: int) -> bool:
        """Marks the slab of a part as lent to a restore: arrays built on its pages
        (mapped copy-on-write) live on after the step is retired, so it is never
        recycled and written again, only unlinked (its pages are freed with the
        last array). Call it while the step is pinned. False if it cannot be marked.
        """
        try:
            (self.part_dir(step, owner) / LENT_MARKER).touch()
            return True
        except OSError as e:
            log.warning("jaxckpt: cannot lend the slab of part %d of step %d: %s", owner, step, e)
            return False

    def commit(self, staging: Path, step: int, owner: int) -> Path:
        """Makes a fully written staging directory the part (step, owner)."""
        final = self.part_dir(step, owner)
        _fs.replace_dir(staging, final)
        return final

    def steps(self) -> list[int]:
        """Steps with at least one committed part, oldest first."""
        found = (_STEP_RE.match(name) for name in _names(self.run_dir))
        return sorted(int(m.group(1)) for m in found if m)

    def parts(self, step: int) -> list[int]:
        """Owners whose part of `step` this tier holds (parts of format versions
        before the slab, left by an older jaxckpt, are not counted, nor parts found
        damaged: `_quarantine`)."""
        step_dir = self.step_dir(step)
        found = (_PART_RE.match(name) for name in _names(step_dir))
        return sorted(
            int(m.group(1))
            for m in found
            if m
            and (step_dir / m.group(0) / _slab.SLAB_FILE).exists()
            and not _quarantine.is_quarantined(step_dir / m.group(0))
        )

    def slab(self, step: int, owner: int) -> Path:
        return self.part_dir(step, owner) / _slab.SLAB_FILE

    def inventory(self) -> dict[int, list[int]]:
        """step -> owners held."""
        return {s: ps for s in self.steps() if (ps := self.parts(s))}

    def read_manifest(self, step: int, owner: int) -> _format.PartManifest | None:
        """The committed manifest of a part, or None if absent or unreadable."""
        try:
            text = (self.part_dir(step, owner) / _format.MANIFEST_FILE).read_text()
            return _format.PartManifest.from_json(text)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def pin(self, step: int) -> Pin:
        """Marks `step` as in use by this process (e.g. waiting to be persisted).

        Pins are locked files, so that every process sharing this memory root
        (several processes on one host, in one container or several) respects
        them; the lock ends with its process, so a dead process's pin is ignored
        (a pid would not do: pids are reused, and differ across containers).
        A pin is an empty file (its holder's record in its name): it needs no
        page of the filesystem, so a full tmpfs can still be pinned and read.
        Call `release()` on the returned pin when done.

        Raises:
          OSError: if the pin file cannot be created (a read-only filesystem).
        """
        return Pin(self.step_dir(step) / f".pin-{_liveness.record()}-{uuid.uuid4().hex[:8]}")

    def is_pinned(self, step: int) -> bool:
        """Whether a live process holds a pin on `step` (False once the step is gone).

        Another process sharing the memory root may delete the step meanwhile
        (its own retention, or a host losing its memory): a missing step holds
        no pin.
        """
        step_dir = self.step_dir(step)
        pins = [step_dir / n for n in _names(step_dir) if n.startswith(".pin-")]
        return any(_liveness.is_held(pin) for pin in pins)

    def retain(self, keep: int, upto: int, pinned: Iterable[int] = ()) -> list[int]:
        """Of the steps up to `upto`, deletes all but the newest `keep`; never a pinned one.

        Steps after `upto` (still being saved) are never touched. Every process
        sharing the memory root computes the same newest steps, so they agree
        on what to delete.

        Returns:
          The steps deleted.
        """
        pinned = set(pinned)
        steps = [s for s in self.steps() if s <= upto]
        doomed = [
            s
            for s in steps[: max(0, len(steps) - keep)]
            if s not in pinned and not self.is_pinned(s)
        ]
        trashed = []
        for step in doomed:
            trash = self.run_dir / ".staging" / _liveness.owned_name(f"trash.{step}")
            try:
                os.rename(self.step_dir(step), trash)
            except OSError:
                continue
            trashed.append(trash)
        # Every doomed step is out before any slab is recycled: the budget judges the
        # steps that stay (`recycle`).
        for trash in trashed:
            for part in sorted(trash.glob("part_*")):
                self.recycle(part)
            _fs.remove_entry(trash)
        if doomed:
            _slab.forget_unlinked()
        # Leftovers of processes that died since this process started (sharing the
        # memory root) go too, not only those found at its start.
        self.clear_staging()
        return doomed

    def recycle(self, part_dir: Path) -> bool:
        """Moves the slab of a retired part (out of its step already) to `.free/`, for
        the next save or received push to fill, while `.free/` holds fewer slabs than
        the newest step has parts; never a lent slab, nor any without `spare_slabs`.
        Whether it moved."""
        if not self.spare_slabs or (part_dir / LENT_MARKER).exists():
            return False
        free = self.run_dir / ".free"
        steps = self.steps()
        spare = len(self.parts(steps[-1])) if steps else 1
        try:
            free.mkdir(exist_ok=True)
            decision = _memory_budget.decide(
                self.memory_budget,
                self._step_bytes(steps) if self.memory_budget is not None else 0,
                [n for p in free.iterdir() if (n := _size(p)) is not None],
                (part_dir / _slab.SLAB_FILE).stat().st_size,
                spare,
            )
            self._tell(decision)
            if not decision.keep:
                return False
            spare_slab = free / f"slab-{uuid.uuid4().hex}"
            os.rename(part_dir / _slab.SLAB_FILE, spare_slab)
            self._recycled.append(spare_slab)
            return True
        except OSError:
            return False

    def _step_bytes(self, steps: Iterable[int]) -> int:
        """Bytes of the slabs of `steps` (committed parts)."""
        total = 0
        for step in steps:
            for owner in self.parts(step):
                with contextlib.suppress(OSError):  # retired meanwhile
                    total += self.slab(step, owner).stat().st_size
        return total

    def _tell(self, decision: _memory_budget.SpareDecision) -> None:
        """Logs what the budget chose, once for each outcome (with a budget only)."""
        told = (decision.spares, decision.over_budget)
        if self.memory_budget is not None and told not in self._told:
            self._told.add(told)
            # Declining a spare for the budget slows the next saves: say so where it shows.
            say = log.warning if decision.over_budget else log.info
            say("jaxckpt: [%s] %s", self.run_dir, decision.describe())

    def dispose(self, part_dir: Path) -> None:
        """Removes a retired part (moved out of its step already), its slab recycled."""
        self.recycle(part_dir)
        _fs.remove_entry(part_dir)
        _slab.forget_unlinked()

    def clear_staging(self, older_than_s: float = math.inf) -> None:
        """Removes what interrupted writes and removals left in `.staging/`.

        An entry goes as soon as the process that made it has certainly ended (a
        crash), however young it is: a restarted process finds its predecessor's
        staging slab at once, and it is a whole part's worth of tmpfs pages. An
        entry whose maker may still run stays. Only an entry whose maker this
        process cannot judge (another pid namespace or boot, or a name without a
        maker, left by an older jaxckpt) is judged by age: it goes once older
        than `older_than_s`.
        """
        now = time.time()

        def left_over(entry: Path) -> bool:
            made_by = _liveness.maker(entry.name)
            gone = _liveness.judge(made_by) if made_by is not None else None
            if gone is not None:
                return gone
            return now - entry.stat().st_mtime >= older_than_s

        if _fs.remove_entries(self.run_dir / ".staging", which=left_over):
            _slab.forget_unlinked()


def _size(path: Path) -> int | None:
    """A file's size, or None if it is gone (a free slab taken meanwhile)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class StagedSlab:
    """A staging directory whose slab holds a part's chunks at `offsets`."""

    staging: Path
    offsets: list[int]
    crcs: list[list[int]] | None  # per chunk, per tile; None: not computed yet (`_slab.checksums`)
    seconds: float  # the write took


def _names(directory: Path) -> list[str]:
    """The entries of `directory`; none once it is gone (another process sharing
    the memory root may delete a step, or a host lose its whole memory root, at
    any moment)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
