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
| restore (`RestoreChoreography`) | `meet` (once per run), `inventories`, `agree` (the verdict), `reshard` (at once after it) |
| list (`ListChoreography`) | `meet` (once per run), `inventories`, `agree` |
| release (`ReleaseChoreography`) | `agree` (every process persisted its part of the newest step), then each frees its own tier |

Every cross-process step of jaxckpt is one of these exchanges, run from this
module (tests/test_layout.py checks that no other module outside `coord/` calls
one): `meet` is `meeting` (the coordinator's `_agreement.agree_each`),
`inventories` is `exchange_inventories` (`_multihost.converge`), `agree` is
`_agreement.agree` (a save's `agree_on_save`), `reshard` is a jax collective
(`_read_layout.reshard`). The modules below take this process's own steps
around them: `_run.Run` opens the run and says what this process holds,
`_peers.Hello` starts and ends its peer service, the read engine reads and
places bytes on this process's devices.

Between exchanges, a process does its own work. A failure there ends that
work, not the choreography: a restore's or a listing's choreography is a
context manager, and an error that leaves its block takes part in every
exchange not yet run (declining the meeting without a memory tier, offering
the inventories only what its tier holds) and is then raised on every process
by `agree`; a save keeps its error (`local`) and takes it to the next
exchange. A local error taken to an exchange the work called (one injected
there) ends that work after the exchange, the same way. An exchange that
raises an agreed error (`_agreement`) ends the choreography on every process
at once. So a failing process takes part by construction, wherever it fails.

Two rules of time and order hold it together. A call to a peer between two
exchanges gives up after half the timeout (`_peers.Peers`), so that a process
that met a stalled peer still reaches the next exchange before the others,
waiting there for the whole timeout, give up on it. And a jax collective
(`reshard`) has no timeout and nothing after it to report a failure: it is
entered only right after a verdict that every process passed.

Each exchange is also a fault point (`_faults`: a hook the tests install fails
this process there, `<operation>.<exchange>`), and so is the opening of the run
(`<operation>.open`): the tests fail one process just before each exchange and
check that every process raises the same error (`restore.reshard`'s failure is
taken to the verdict just before it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import ClassVar

import jax
from absl import logging as log

from jaxckpt import _faults, _metrics
from jaxckpt.coord import _agreement, _holdings, _multihost, _placement, _read_layout
from jaxckpt.format import _format
from jaxckpt.peer import _peers
from jaxckpt.run import _run
from jaxckpt.tiers import _index, _memory_tier, _paths


def meeting(hello: _peers.Hello) -> _peers.Peers:
    """The exchange `meet` itself (collective, once per run): every process's peer
    service and failure domain posted, the replicas placed once by the decider, each
    process told its holders and its relay group (`_peers`).

    Args:
      hello: this process's side of it (`_peers.Hello`: started, or declined).

    Returns:
      This process's `Peers` (replicas that cannot be placed are not an error here:
      `Peers.holders` raises it, where a save needs them).

    Raises:
      On every process alike: this process's error (`hello.error`), or another's
      (the same built-in type, naming it); TimeoutError if a process does not take
      part in time.
    """
    # Published before the exchange: once it ends, every address is there to look up.
    hello.publish()
    try:
        # A process that cannot serve takes part all the same, with its error, so that
        # the others raise it at once. The exchange forms the relay groups: it goes
        # straight to the coordinator, whatever an earlier run left bound.
        with _multihost.direct():
            common, told = _agreement.agree_each(
                hello.error,
                tag=hello.tag,
                what=hello.what,
                timeout_s=hello.options.timeout_s,
                payload=hello.payload(),
                share=hello.share,
            )
    except BaseException:
        hello.abandon()
        raise
    peers = hello.met(common, told)
    # Every process binds its relay group here, right after the same exchange, so that
    # no leader waits for a member that posts elsewhere.
    _multihost.use_relay(peers.relay)
    return peers


def exchange_inventories(
    run_id: str, local: _peers.Inventory, timeout_s: float
) -> _holdings.Holdings:
    """The exchange `inventories` itself (collective): who holds which part of which
    step, every process. Each posts `local` as offsets from itself; the decider groups
    the processes by what they posted and every process reads only the groups
    (`_holdings`): a few hundred bytes and O(distinct inventories) of decoding,
    whatever the process count."""
    outcome = _multihost.converge(
        _holdings.wire(_multihost.process_index(), local),
        _holdings.combine,
        tag=f"inventory/{run_id}",
        timeout_s=timeout_s,
    )
    return _holdings.decode(outcome, _multihost.process_count())


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

    def _enter(
        self, name: str, error: BaseException | None, inject: bool = True
    ) -> BaseException | None:
        """Enters the exchange `name` (each once, in `EXCHANGES` order); returns the local
        error it takes: this process's first (`error`, or, with `inject`, one injected
        for the tests)."""
        done = len(self._done)
        expected = self.EXCHANGES[done] if done < len(self.EXCHANGES) else None
        if name != expected:
            raise RuntimeError(
                f"[process {self._process}] jaxckpt's {self.VERB} ran the exchange {name!r} "
                f"out of order: after {self._done}, the next is {expected!r}."
            )
        self._done.append(name)
        if self.error is None:
            self.error = error
        if self.error is None and inject:
            self.error = _faults.failure(f"{self.VERB}.{name}", self.step, self._process)
        return self.error

    def _meet(self, error: BaseException | None, place: bool) -> _peers.Peers | None:
        """The exchange `meet`: the run's peers, met once per run (`meeting`, where they
        are not met yet, in several processes). Without a memory tier (`error` says why),
        this process declines: every process raises. With `place`, the replicas'
        placement is checked (a save's)."""
        error = self._enter("meet", error)
        run_id = self._required_item().run_id(
            self._options.run_id, self._recorded.run_id if self._recorded else None
        )
        try:
            self.peers = self._run.peers_of(run_id)
            if self.peers is None and _multihost.process_count() > 1:
                hello = (
                    _peers.Hello.serving(self.memory, self._options)
                    if self.memory is not None
                    else _peers.Hello.declined(
                        run_id, self._options, error or RuntimeError("no memory tier")
                    )
                )
                self.peers = self._run.adopt(meeting(hello))
        except Exception:
            self._unmet = True
            raise
        if self.memory is None:
            return None
        if place:  # computing the placement validates it
            if self.peers is not None:
                self.peers.holders  # noqa: B018
            else:
                _placement.place_replicas(
                    [self._options.resolved_failure_domain], self._options.replicas
                )
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
            if (name == "inventories" and self._unmet) or name == "reshard":
                # No inventories without the peers met; no reshard after a verdict, which
                # raised an error on every process (in one, as it is).
                self._enter(name, error, inject=False)
                continue
            exchanges[name]()
        raise error

    def _inventories(
        self, error: BaseException | None, indexes: dict[int, _index.Index] | None = None
    ) -> _index.GlobalView:
        """The exchange `inventories`: what every process holds in memory, for every
        finalized step (`exchange_inventories`, once the run's peers are met; alone, this
        process's). With a local error, this process offers what its tier holds, or
        nothing without one, and fails afterwards (in `agree`)."""
        self._enter("inventories", error)
        held = self._run.held(self._required_item(), self.memory, indexes)
        if self.peers is None:
            return held.view()
        return held.view(
            exchange_inventories(self.peers.run_id, held.local, self._options.timeout_s)
        )

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

    EXCHANGES: ClassVar[tuple[str, ...]] = ("meet", "inventories", "agree")

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
    """A restore: 1. `meet` (once per run), 2. `inventories`, 3. `agree` (the verdict),
    4. `reshard` (the leaves read 1/R a process, onto their targets).

    Used as a context manager around the restore's own work (see the module
    docstring): a failure anywhere in it is published and agreed on.
    """

    VERB = "restore"
    EXCHANGES = ("meet", "inventories", "agree", "reshard")

    def __init__(self, run: _run.Run, item: _paths.ItemDir, publisher: _metrics.Publisher):
        super().__init__(run, item, item.step)
        self._publisher = publisher

    def __enter__(self) -> RestoreChoreography:
        return self

    def agree_and_reshard(self, resharding: _read_layout.Resharding) -> list[jax.Array]:
        """3. The verdict: every process read and placed its leaves, or all raise. Then
        at once 4. the reshard: the leaves read 1/R a process carried onto their targets
        by one jax collective (`_read_layout.reshard`; none where no leaf needs it, the
        same on every process, whose plans and targets agree).

        A jax collective has no timeout, and nothing after it could tell the others of
        a failure: so every process enters it only once all agreed to, with nothing
        run between the two, and a failure injected before the reshard
        (`restore.reshard`) is taken to the verdict.

        Returns:
          The arrays of `resharding`, on their targets' shardings, in order.
        """
        error = _faults.failure(f"{self.VERB}.reshard", self.step, self._process)
        self._agree(error, self._what())
        self._enter("reshard", None, inject=False)
        if not resharding.arrays:
            return []
        return list(
            _read_layout.reshard(
                list(resharding.arrays), list(resharding.targets), list(resharding.layouts)
            )
        )

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
        deciding process writes the step's one index within the exchange, once every
        process committed the same tree and before any returns: a step is indexed by
        every process or by none. A save enters it only once its part is committed in
        memory and pushed to its holders (`_save.Save.commit`), so that an index never
        points at copies that do not exist."""
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
