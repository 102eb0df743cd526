"""One choreography per collective operation: its exchanges in order, run by every process.

A save, a restore, a listing of the restorable steps and a release are
collective: every process calls them, and the processes meet in the same
exchanges in the same order. A process that fails between two exchanges must
still take part in every exchange after its failure, or the others wait there
until their timeout (on a thousand hosts, a hang). Each operation's
choreography names its exchanges in order (`EXCHANGES`), and runs each one
with an optional local error:

| operation | exchanges, in order |
|---|---|
| save (`SaveChoreography`) | `meet` (the peers, once per run; in `async_save`), `agree` (the commit's verdict, before the index manifest) |
| restore (`RestoreChoreography`) | `meet` (once per run), `inventories`, `agree` (the verdict) |
| list (`ListChoreography`) | `meet` (once per run), `inventories`, `agree` |
| release (`ReleaseChoreography`) | `agree` (every process persisted its part of the newest step), then each frees its own tier |

Between exchanges, a process does its own work. A failure there ends that
work, not the choreography: a restore's or a listing's choreography is a
context manager, and an error that leaves its block takes part in every
exchange not yet run (declining the meeting without a memory tier, offering
the inventories only what its tier holds) and is then raised on every process
by the last one (`agree`); a save keeps its error (`local`) and takes it to the
next exchange. A local error taken to an exchange the work called (one
injected there) ends that work after the exchange, the same way. An exchange that raises an
agreed error (`_agreement`) ends the choreography on every process at once.
So a failing process takes part by construction, wherever it fails.

Each exchange is also a fault point (`_faults`: a hook the tests install fails
this process there, `<operation>.<exchange>`), and so is the opening of the run
(`<operation>.open`): the tests fail one process just before each exchange and
check that every process raises the same error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import ClassVar

from absl import logging as log

from jaxckpt import _faults, _metrics
from jaxckpt.coord import _agreement, _multihost
from jaxckpt.format import _format
from jaxckpt.peer import _peers
from jaxckpt.run import _run
from jaxckpt.tiers import _index, _memory_tier, _paths


class Choreography:
    """One collective operation of this process: its exchanges in order (`EXCHANGES`).

    Attributes:
      error: this process's first error in the operation (None while it goes well).
      memory: the run's memory tier, once `open` opened it.
      peers: the run's peers, once `meet` met them (None in one process).
    """

    VERB: ClassVar[str]  # the operation's name in tags and fault points
    EXCHANGES: ClassVar[tuple[str, ...]]

    def __init__(self, run: _run.Run, item: _paths.ItemDir | None, step: int | None):
        self._run, self._item, self.step = run, item, step
        self._options = run.options
        self._process = _multihost.process_index()
        self.error: BaseException | None = None
        self.memory: _memory_tier.MemoryTier | None = None
        self.peers: _peers.Peers | None = None
        self._recorded: _format.PartManifest | None = None
        self._done: list[str] = []  # the exchanges taken part in, in order
        # The meeting failed (every process that took part in it got the failure): there
        # are no peers to exchange inventories with; the verdict is still agreed on.
        self._unmet = False

    # ---- the local steps ------------------------------------------------------

    def open(
        self,
        recorded: _format.PartManifest | None = None,
        indexes: dict[int, _index.Index] | None = None,
    ) -> _memory_tier.MemoryTier:
        """Opens the run (`_run.Run.open`): step 1, before the first exchange.

        Args:
          recorded: a manifest of the step's index: the run id its copies carry.
          indexes: step -> index manifests read already (not read again).
        """
        self._recorded = recorded
        _faults.at(f"{self.VERB}.open", self.step, self._process)
        self.memory = self._run.open(self._required_item(), recorded, indexes)
        return self.memory

    # ---- the exchanges -----------------------------------------------------------

    def _enter(self, name: str, error: BaseException | None) -> BaseException | None:
        """Enters the exchange `name` (each once, in `EXCHANGES` order); returns the local
        error it takes: this process's first (`error`, or one injected for the tests)."""
        done = len(self._done)
        expected = self.EXCHANGES[done] if done < len(self.EXCHANGES) else None
        if name != expected:
            raise RuntimeError(
                f"[process {self._process}] jaxckpt's {self.VERB} ran the exchange {name!r} "
                f"out of order: after {self._done}, the next is {expected!r}."
            )
        self._done.append(name)
        if self.error is None:
            self.error = error or _faults.failure(f"{self.VERB}.{name}", self.step, self._process)
        return self.error

    def _meet(self, error: BaseException | None, place: bool) -> _peers.Peers | None:
        """The exchange `meet`: the peers, met once per run (collective where they are not
        met yet). With a local error and no memory tier, declines: every process raises."""
        error = self._enter("meet", error)
        run_id = self._required_item().run_id(
            self._options.run_id, self._recorded.run_id if self._recorded else None
        )
        try:
            self.peers = self._run.meet(self.memory, run_id, error, place)
        except Exception:
            self._unmet = True
            raise
        return self.peers

    def _agree(self, error: BaseException | None, what: str) -> None:
        """The exchange `agree`: raises on every process if this one or another failed."""
        error = self._enter("agree", error)
        _agreement.agree(error, tag=self._tag(), what=what, timeout_s=self._options.timeout_s)

    def _tag(self) -> str:
        """The name every process's exchanges of this operation meet under."""
        return self._required_item().tag(self.VERB, self._options.run_id)

    def _finish(self, error: BaseException) -> None:
        """Takes part in every exchange not run yet, with `error`; the last raises it on
        every process (an exchange that raises an agreed error ends the rest at once)."""
        exchanges: dict[str, Callable[[], object]] = {
            "meet": lambda: self._meet(error, place=False),
            "inventories": lambda: self._inventories(error),
            "agree": lambda: self._agree(error, self._what()),
        }
        for name in self.EXCHANGES[len(self._done) :]:
            if name == "inventories" and self._unmet:
                self._enter(name, error)
                continue
            exchanges[name]()
        raise error

    def _inventories(
        self, error: BaseException | None, indexes: dict[int, _index.Index] | None = None
    ) -> _index.GlobalView:
        """The exchange `inventories`: what every process holds in memory (collective).
        With a local error, this process offers what its tier holds, or nothing without
        one, and fails afterwards (in `agree`)."""
        self._enter("inventories", error)
        return self._run.inventories(self._required_item(), self.memory, indexes)

    def _raise_kept(self) -> None:
        """After an exchange the operation's own work called: a local error taken to it
        (one injected there) ends that work; the exchanges left run as the block ends."""
        if self.error is not None:
            raise self.error

    def _what(self) -> str:
        return f"The {self.VERB} of step {self.step}"

    def _required_item(self) -> _paths.ItemDir:
        if self._item is None:
            raise RuntimeError(f"jaxckpt's {self.VERB} has no item directory")
        return self._item

    # ---- a block of local work between the exchanges ------------------------------

    def __enter__(self) -> Choreography:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Runs the exchanges the block did not: with no error, the rest (the verdict);
        with one, every one left, with it, so that every process raises it."""
        if error is None:
            for name in self.EXCHANGES[len(self._done) :]:
                if name != "agree":
                    raise RuntimeError(
                        f"[process {self._process}] jaxckpt's {self.VERB} ended without its "
                        f"exchange {name!r}."
                    )
                self._agree(None, self._what())
            return
        if not isinstance(error, Exception):
            return  # an interrupt: no exchange; the process is going down
        self._failed(error)
        if not _agreement.is_agreed(error):
            self._finish(error)

    def _failed(self, error: BaseException) -> None:
        """Told of this process's error before it is agreed on."""
        if self.error is None:
            self.error = error


class _Collective(Choreography):
    """A restore or a listing: 1. `meet` (once per run), 2. `inventories`, 3. `agree`,
    around the operation's own work (a context manager: see the module docstring)."""

    EXCHANGES = ("meet", "inventories", "agree")

    def meet(self) -> _peers.Peers | None:
        """1. The peers, met once per run (reading needs no placement)."""
        peers = self._meet(None, place=False)
        self._raise_kept()
        return peers

    def inventories(self, indexes: dict[int, _index.Index] | None = None) -> _index.GlobalView:
        """2. What every process holds in memory, for every finalized step (collective).

        Args:
          indexes: step -> index manifests read already (not read again).
        """
        view = self._inventories(None, indexes)
        self._raise_kept()
        return view


class RestoreChoreography(_Collective):
    """A restore: 1. `meet` (once per run), 2. `inventories`, 3. `agree` (the verdict).

    Used as a context manager around the restore's own work (see the module
    docstring): a failure anywhere in it is published and agreed on.
    """

    VERB = "restore"

    def __init__(self, run: _run.Run, item: _paths.ItemDir, publisher: _metrics.Publisher):
        super().__init__(run, item, item.step)
        self._publisher = publisher

    def __enter__(self) -> RestoreChoreography:
        return self

    def agree(self, error: BaseException | None = None) -> None:
        """3. The verdict, held early: before a collective every process must enter
        together (the reshard of data-parallel replicas), so that none enters it alone
        while another has failed. The block's end then runs no exchange."""
        self._agree(error, self._what())

    def _failed(self, error: BaseException) -> None:
        super()._failed(error)
        self._publisher.failure("restore", self.step, self._run.redact(str(error)))


class ListChoreography(_Collective):
    """A listing of the restorable steps: 1. `meet`, 2. `inventories`, 3. `agree`."""

    VERB = "list"

    def __init__(self, run: _run.Run, item: _paths.ItemDir):
        super().__init__(run, item, item.step)

    def __enter__(self) -> ListChoreography:
        return self

    def _what(self) -> str:
        return "Finding the restorable steps"


class ReleaseChoreography(Choreography):
    """A release of the memory tier at the end of a run: 1. `agree` (every process has
    persisted its part of the newest step), then each frees its own tier.

    Used as a context manager around the release's own work: a failure before the
    verdict is taken to it, so that every process raises it.
    """

    VERB = "release"
    EXCHANGES = ("agree",)

    def __init__(self, run: _run.Run):
        super().__init__(run, None, None)

    def __enter__(self) -> ReleaseChoreography:
        return self

    def agree(self) -> None:
        """1. The verdict: raises on every process if one failed to persist its part."""
        self._agree(None, self._what())
        self._raise_kept()

    def _tag(self) -> str:
        # No run in the name: a process that never used the run's tier meets the others
        # all the same.
        return "release_memory"

    def _what(self) -> str:
        return "Persisting the newest step to release the memory tier"


class SaveChoreography(Choreography):
    """A save: 1. `meet` (once per run, in `async_save`), 2. `agree` (in the commit).

    The save's errors are raised by its commit future, never by `async_save`
    (that would strand Orbax's directory-creation threads): an error in the
    local work (`local`) is kept, taken to the meeting, and agreed on in the
    commit, where every process raises it.
    """

    VERB = "save"
    EXCHANGES = ("meet", "agree")

    def __init__(
        self, run: _run.Run, item: _paths.ItemDir, step: int, publisher: _metrics.Publisher
    ):
        super().__init__(run, item, step)
        self._publisher = publisher
        self._ended = False  # an exchange raised an agreed error: every process has it

    @property
    def ok(self) -> bool:
        """Whether this process's save has not failed so far."""
        return self.error is None

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """This process's own work before the next exchange: an error inside is kept
        (this process refuses the save), not raised."""
        try:
            yield
        except Exception as error:
            self._failed(error)

    def meet(self) -> _peers.Peers | None:
        """1. The peers, met once per run, the replicas' placement checked. A process that
        refused the save meets them too: with its memory tier it serves as usual (its
        refusal is agreed on in the commit), without one it declines."""
        try:
            return self._meet(self.error, place=True)
        except Exception as error:
            self._failed(error)
            self._ended = _agreement.is_agreed(error)
            return None

    async def agree(
        self,
        leaves: Sequence[_format.LeafRecord] | None,
        entry: str | None = None,
        write_index: _agreement.WriteIndex | None = None,
    ) -> None:
        """2. The commit's verdict (`_agreement.agree_on_save`): every process committed
        the same tree, or all raise. With this part's index `entry` and `write_index`, the
        deciding process writes the step's one index before any process returns."""
        error = self._enter("agree", None)
        # Blocking, on the commit future's own thread and event loop (Orbax's): no hop
        # to an executor thread, which that fresh loop would start anew at every save.
        _agreement.agree_on_save(
            leaves,
            error,
            tag=self._required_item().tag(self.VERB, self._options.run_id),
            step=self.step,
            timeout_s=self._options.timeout_s,
            entry=entry if error is None else None,
            write_index=write_index if error is None else None,
        )

    def commit(self, work: Callable[[], Awaitable[None]] | None) -> Awaitable[None]:
        """The commit future: `work` (the save's commit, which runs `agree`), or, if this
        process refused the save, its refusal; a failure is agreed on either way."""
        if work is None or self.error is not None:
            error = self.error or RuntimeError("no memory tier")
            log.error(
                "jaxckpt: [process %d] save into %s refused: %s",
                self._process,
                self._required_item().path,
                error,
            )
            return self._agreed(None, error)
        return self._agreed(work, None)

    async def _agreed(
        self, work: Callable[[], Awaitable[None]] | None, refusal: BaseException | None
    ) -> None:
        try:
            if refusal is not None:
                raise refusal
            assert work is not None
            await work()
        except Exception as error:
            self._publisher.failure("save", self.step, self._run.redact(str(error)))
            self._failed(error)
            if "agree" not in self._done and not self._ended and not _agreement.is_agreed(error):
                await self.agree(None)  # takes this process's error: every process raises
            raise
