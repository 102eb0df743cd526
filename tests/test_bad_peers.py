"""Dead or misbehaving peers: bounded time, then a fallback or a clear error; never wrong values.

Restores here run through the real handler and `ocp.CheckpointManager` in one
process. `FakePeers` stands in for the rest of a job: it tells the handler that
a pretend process 1 holds a copy of process 0's part, at an address that is a
real `PeerServer` or a broken endpoint (closed port, silent listener, slow or
stalled proxy, another run's server, another token). Process 0's own memory
copy is deleted first (a lost node), so the peer is the first source tried;
the persisted copy is the fallback, or is deleted too.

Also here: the peer service's token, interface binding, path confinement and
request size limits, at the level of the run's meeting (`_choreography.meeting`) and raw HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import portpicker
import pytest
from helpers import (
    abstract,
    assert_tree_equal,
    attach_peers,
    flip_slab_byte,
    manager,
    mesh_1d,
    restore,
    save,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._options import TierOptions
from jaxckpt.coord import _holdings
from jaxckpt.format import _format
from jaxckpt.peer import _peers
from jaxckpt.peer._client import check_part, fetch_file
from jaxckpt.peer._server import PeerServer
from jaxckpt.peer._wire import TOKEN_HEADER, PeerAddress
from jaxckpt.run import _choreography
from jaxckpt.tiers import _index, _memory_tier, _quarantine

RUN = "bad-peers-run"
TOKEN = "a" * 64
TIMEOUT_S = 1.0  # the restoring handler's TierOptions.timeout_s
BOUND_S = 8 * TIMEOUT_S  # a restore must end (restored or refused) within this
HANG_S = 10.0  # a restore still running after this is counted as a hang


# ---- broken endpoints ---------------------------------------------------------


def closed_port() -> PeerAddress:
    """An address where nothing listens (a dead peer)."""
    return PeerAddress("127.0.0.1", portpicker.pick_unused_port())


class Silent:
    """Accepts connections and never answers (a hung peer)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = PeerAddress("127.0.0.1", self._listener.getsockname()[1])
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)

    def close(self) -> None:
        self._listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()


class Proxy:
    """Forwards TCP to `target`, sleeping `delay` s per `chunk` bytes; `stall` stops forwarding."""

    def __init__(self, target: PeerAddress, *, delay: float = 0.0, chunk: int = 1 << 16):
        self.target, self.delay, self.chunk = target, delay, chunk
        self.stall = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = PeerAddress("127.0.0.1", self._listener.getsockname()[1])
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.target.host, self.target.port))
            except OSError:  # the peer behind the proxy is down: so is the proxied one
                client.close()
                continue
            self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed:
                if self.stall.is_set():
                    time.sleep(0.05)
                    continue
                data = src.recv(self.chunk)
                if not data:
                    break
                time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


# ---- a pretend job around one process ----------------------------------------


class FakePeers(_peers.Peers):
    """Process 0's `Peers` in a pretend two-process job: process 1 lives at `peer`.

    `held` says which parts process 1 claims to hold (step -> owners). With
    `holder_memory` (process 1's memory tier) and `ckpt_dir`, process 1's
    inventory is instead computed as a real holder computes it: the copies in
    its memory whose manifest matches the step's index. With `push`, process 0
    pushes its replicas to process 1.
    """

    def __init__(
        self,
        own: PeerServer,
        peer: PeerAddress,
        *,
        run_id: str = RUN,
        held: dict[int, set[int]] | None = None,
        push: bool = False,
        timeout_s: float = TIMEOUT_S,
        token: str = TOKEN,
        holder_memory: _memory_tier.MemoryTier | None = None,
        ckpt_dir: Path | None = None,
    ):
        replicas = 1 if push else 0  # two failure domains: process 1 holds process 0's copy
        addresses = _peers.Addresses(run_id, {0: own.address, 1: peer}, timeout_s)
        holders = (1,) if push else ()
        super().__init__(own, token, run_id, addresses, holders, replicas, timeout_s)
        self.held = held or {}
        self.holder_memory, self.ckpt_dir = holder_memory, ckpt_dir

    def exchange_inventories(self, local: _peers.Inventory) -> _holdings.Holdings:
        """The pretend job's exchange of inventories (`attach` puts it in the real one's
        place): process 0's, and what process 1 holds."""
        held = {s: set(o) for s, o in self.held.items()}
        if self.holder_memory is not None and self.ckpt_dir is not None:
            for s in self.holder_memory.steps():
                index = _index.read_index(self.ckpt_dir / str(s) / "train")
                held[s] = _index.memory_parts(self.holder_memory, s, index)
        return _holdings.Holdings.of({0: local, 1: held})


def own_server(root: Path, run_id: str = RUN) -> PeerServer:
    server = PeerServer(root, run_id=run_id, token=TOKEN)
    server.start()
    return server


def small_state(step: int) -> dict[str, Any]:
    """Two array leaves (one sharded in 8 chunks, one replicated) and a scalar, unique per step."""
    rng = np.random.default_rng(step)
    mesh = mesh_1d()
    return {
        "w": jax.device_put(
            rng.standard_normal((16, 6)).astype(np.float32), NamedSharding(mesh, P("data"))
        ),
        "b": jax.device_put(rng.standard_normal(5).astype(np.float32), NamedSharding(mesh, P())),
        "step": step,
    }


def copy_part(
    memory_root: str, step: int, dest_root: Path, *, as_step: int | None = None, run_id: str = RUN
) -> Path:
    """Copies process 0's memory part of `step` into another memory root (a peer's)."""
    src = _memory_tier.MemoryTier(memory_root, RUN).part_dir(step, 0)
    dst = _memory_tier.MemoryTier(str(dest_root), run_id).part_dir(
        step if as_step is None else as_step, 0
    )
    shutil.copytree(src, dst)
    return dst


# ---- outcome of one restore ---------------------------------------------------


@dataclasses.dataclass
class Outcome:
    kind: str  # "ok", "wrong", "error", "hang"
    seconds: float
    error: BaseException | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


def bounded(fn: Callable[[], Any], expected: Any, h: Any, hang_s: float = HANG_S) -> Outcome:
    """Runs a restore in a thread; classifies it as ok / wrong values / error / hang."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # classified below
            box["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True, name="bounded-restore")
    thread.start()
    thread.join(hang_s)
    seconds = time.monotonic() - start
    if thread.is_alive():
        return Outcome("hang", seconds)
    if "error" in box:
        return Outcome("error", seconds, box["error"])
    try:
        assert_tree_equal(box["value"], expected)
    except AssertionError as e:
        return Outcome("wrong", seconds, e)
    return Outcome("ok", seconds, metrics=dict(h.last_restore_metrics))


def tally(test: str, tier: str, outcome: Outcome) -> None:
    """One line per scenario x tier, for the suite's counts (`pytest -s | grep TALLY`)."""
    print(f"TALLY {test} tier={tier} outcome={outcome.kind} seconds={outcome.seconds:.2f}")


# ---- restores through a bad peer -----------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """Steps 0 and 1 saved and persisted by process 0; yields (memory_root, ckpt_dir)."""
    memory_root, ckpt = str(tmp_path / "memory"), tmp_path / "ckpt"
    h = jaxckpt.TieredCheckpointHandler(
        TierOptions(memory_root, run_id=RUN, persist_every=1, memory_keep=2)
    )
    with manager(ckpt, h) as mngr:
        for step in (0, 1):
            save(mngr, step, small_state(step))
        mngr.wait_until_finished()
        h.wait_for_persistence()
    return memory_root, ckpt


@contextlib.contextmanager
def bad_peer(kind: str, memory_root: str, tmp_path: Path) -> Iterator[PeerAddress]:
    """A pretend process 1 that holds (or claims to hold) process 0's part of step 1."""
    peer_root = tmp_path / f"peer-{kind}"
    closers: list[Callable[[], None]] = []
    try:
        if kind in ("good", "slow", "trickle", "stalled", "wrong_bytes", "wrong_step"):
            if kind == "wrong_step":
                copy_part(memory_root, 0, peer_root, as_step=1)  # step 0's bytes at step 1
            else:
                part = copy_part(memory_root, 1, peer_root)
                if kind == "wrong_bytes":
                    flip_slab_byte(part, "['w']", (0, 0), at=5, bit=0x10)
            server = PeerServer(peer_root, run_id=RUN, token=TOKEN)
            server.start()
            closers.append(server.close)
            address = server.address
            if kind in ("slow", "trickle", "stalled"):
                delay = {"slow": 0.02, "trickle": 3 * TIMEOUT_S, "stalled": 0.0}[kind]
                proxy = Proxy(address, delay=delay, chunk=4096 if kind == "slow" else 64)
                if kind == "stalled":
                    proxy.stall.set()
                closers.append(proxy.close)
                address = proxy.address
        elif kind == "other_run":
            copy_part(memory_root, 1, peer_root, run_id="another-run")
            server = PeerServer(peer_root, run_id="another-run", token=TOKEN)
            server.start()
            closers.append(server.close)
            address = server.address
        elif kind == "wrong_token":
            copy_part(memory_root, 1, peer_root)
            server = PeerServer(peer_root, run_id=RUN, token="b" * 64)
            server.start()
            closers.append(server.close)
            address = server.address
        elif kind == "down":
            address = closed_port()
        elif kind == "hang":
            silent = Silent()
            closers.append(silent.close)
            address = silent.address
        else:
            raise ValueError(kind)
        yield address
    finally:
        for close in reversed(closers):
            close()


BAD_KINDS = [
    "down",
    "hang",
    "trickle",
    "stalled",
    "wrong_bytes",
    "wrong_step",
    "other_run",
    "wrong_token",
]


def restore_through_peer(kind, fallback, saved, tmp_path, monkeypatch) -> tuple[Outcome, Any]:
    memory_root, ckpt = saved
    expected = small_state(1)
    h = jaxckpt.TieredCheckpointHandler(TierOptions(memory_root, run_id=RUN, timeout_s=TIMEOUT_S))
    own = own_server(tmp_path / "own")
    with bad_peer(kind, memory_root, tmp_path) as address:
        shutil.rmtree(_memory_tier.MemoryTier(memory_root, RUN).step_dir(1))  # node loss
        if not fallback:
            shutil.rmtree(ckpt / "1" / "train" / _format.part_dir_name(0))
        attach_peers(h, FakePeers(own, address, held={1: {0}}), monkeypatch)
        mngr = manager(ckpt, h)
        try:
            outcome = bounded(lambda: restore(mngr, 1, abstract(expected)), expected, h)
        finally:
            if outcome.kind != "hang":
                mngr.close()
    return outcome, h


@pytest.mark.parametrize("kind", ["good", "slow"])
def test_a_good_or_slow_peer_serves_the_lost_part(kind, saved, tmp_path, monkeypatch):
    outcome, _ = restore_through_peer(kind, False, saved, tmp_path, monkeypatch)
    tally(f"peer_{kind}", "peer", outcome)
    assert outcome.kind == "ok", outcome
    assert outcome.metrics["tier"] == "peer" and outcome.metrics["fallbacks"] == 0, outcome
    assert outcome.seconds < BOUND_S


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_peer_falls_back_to_persistent_in_bounded_time(kind, saved, tmp_path, monkeypatch):
    outcome, _ = restore_through_peer(kind, True, saved, tmp_path, monkeypatch)
    tally(f"bad_peer_{kind}_fallback", "peer+persistent", outcome)
    assert outcome.kind == "ok", f"{kind}: {outcome}"
    assert outcome.seconds < BOUND_S, f"{kind}: took {outcome.seconds:.1f} s"
    assert "persistent" in outcome.metrics["bytes_by_tier"], outcome.metrics
    assert outcome.metrics["fallbacks"] >= 1, outcome.metrics


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_peer_without_fallback_is_a_clear_error(kind, saved, tmp_path, monkeypatch):
    outcome, _ = restore_through_peer(kind, False, saved, tmp_path, monkeypatch)
    tally(f"bad_peer_{kind}_nofallback", "peer", outcome)
    assert outcome.kind == "error", f"{kind}: {outcome}"
    assert outcome.seconds < BOUND_S, f"{kind}: took {outcome.seconds:.1f} s"
    message = str(outcome.error)
    assert isinstance(outcome.error, FileNotFoundError), repr(outcome.error)
    assert "at step 1" in message and "peer of process 1" in message, message
    assert TOKEN not in message and "b" * 64 not in message


def test_a_silent_peer_is_reported_with_the_bound_the_restore_waited(saved, tmp_path, monkeypatch):
    """A peer's range read waits half the run's timeout: the error (and the fallback
    warning) says that bound, not the whole timeout."""
    outcome, _ = restore_through_peer("hang", False, saved, tmp_path, monkeypatch)
    assert outcome.kind == "error", outcome
    message = str(outcome.error)
    assert f"no answer within {TIMEOUT_S / 2:g} s" in message, message
    assert f"within {TIMEOUT_S:g} s" not in message, message


def test_a_peer_copy_that_fails_its_checksum_is_quarantined_by_its_holder(
    saved, tmp_path, monkeypatch
):
    """The restoring process tells the holder; the holder checks its copy itself and
    quarantines it, so its inventory no longer offers it (the next resume does not
    pick that copy, or that step, again)."""
    outcome, _ = restore_through_peer("wrong_bytes", False, saved, tmp_path, monkeypatch)
    assert outcome.kind == "error", outcome
    held = _memory_tier.MemoryTier(str(tmp_path / "peer-wrong_bytes"), RUN)
    assert _quarantine.is_quarantined(held.part_dir(1, 0))
    assert held.parts(1) == [] and held.inventory() == {}


def test_a_holder_checks_its_copy_before_quarantining_it(saved, tmp_path):
    """Bytes damaged on the way are not the holder's copy's fault: a whole copy stays."""
    memory_root, _ = saved
    peer_root = tmp_path / "peer"
    part = copy_part(memory_root, 1, peer_root)
    server = PeerServer(peer_root, run_id=RUN, token=TOKEN)
    server.start()
    try:

        def check() -> str | None:
            relpath = "step_000000000001/part_00000"
            return check_part(server.address, token=TOKEN, run_id=RUN, relpath=relpath, timeout=5)

        assert check() is None
        assert not _quarantine.is_quarantined(part)
        flip_slab_byte(part, "['w']", (3, 0), at=1, bit=0x02)
        assert check() == "checksum mismatch of chunk (3, 0) of ['w']"
        assert _quarantine.is_quarantined(part)
        assert _memory_tier.MemoryTier(str(peer_root), RUN).parts(1) == []
    finally:
        server.close()


# ---- the peer service of a real meeting -------------------------------------------


def _raw(address: PeerAddress, request: bytes, timeout: float = 5.0) -> bytes:
    """Sends one raw request (its headers get `Connection: close`); returns the whole answer."""
    head, sep, body = request.partition(b"\r\n\r\n")
    request = head + b"\r\nConnection: close" + sep + body
    with socket.create_connection((address.host, address.port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response else 0


@pytest.fixture
def connected(tmp_path, caplog):
    """A one-process meeting (`_choreography.meeting`) bound to 127.0.0.2, everything logged."""
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "memory"
    options = TierOptions(str(root), peer_host="127.0.0.2", run_id=RUN, timeout_s=0.5)
    memory = _memory_tier.MemoryTier(str(root), RUN)
    memory.prepare(str(tmp_path / "ckpt"), 0)
    try:
        peers = _choreography.meeting(_peers.Hello.serving(memory, options))
    except OSError as e:  # pragma: no cover - loopback aliases missing
        pytest.skip(f"cannot bind 127.0.0.2: {e}")
    yield peers, root
    peers.close()


def test_token_is_random_per_run_and_never_logged(connected, tmp_path, caplog):
    peers, root = connected
    token = peers.token
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
    other_root = tmp_path / "other"
    other_memory = _memory_tier.MemoryTier(str(other_root), RUN)
    other_memory.prepare(str(tmp_path / "ckpt2"), 0)
    other = _choreography.meeting(
        _peers.Hello.serving(other_memory, TierOptions(str(other_root), run_id=RUN))
    )
    try:
        assert other.token != token
    finally:
        other.close()
    (root / RUN / "f").write_bytes(b"secret")
    address = peers.addresses[0]
    assert fetch_file(address, token=token, run_id=RUN, relpath="f", timeout=2) == b"secret"
    with pytest.raises(PermissionError) as err:
        fetch_file(address, token="x" + token[1:], run_id=RUN, relpath="f", timeout=2)
    no_token = _raw(address, f"GET /files/{RUN}/f HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert _status(no_token) == 403 and b"secret" not in no_token
    assert token not in caplog.text and token not in str(err.value)


def test_service_binds_only_the_configured_interface(connected):
    peers, _ = connected
    address = peers.addresses[0]
    assert address.host == "127.0.0.2"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", address.port), timeout=2).close()
    socket.create_connection((address.host, address.port), timeout=2).close()


def test_service_drops_a_stalled_client_within_the_run_timeout(connected):
    """The service's per-connection timeout follows TierOptions.timeout_s (0.5 s here)."""
    peers, _ = connected
    address = peers.addresses[0]
    with socket.create_connection((address.host, address.port), timeout=3) as s:
        s.sendall(b"GET /files/x HTTP/1.1\r\n")  # never finishes its headers
        start = time.monotonic()
        with contextlib.suppress(TimeoutError):
            s.recv(100)
        assert time.monotonic() - start < 2.5, "a stalled client holds a service thread"


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", f"/files/{RUN}/..%2f..%2fsecret"),
        ("GET", f"/files/{RUN}/%2e%2e%2f%2e%2e%2fsecret"),
        ("GET", f"/files/{RUN}/%252e%252e/secret"),
        ("GET", "/files/..%2f/secret"),
        ("GET", f"/files/{RUN}%2f..%2f../secret"),
        ("GET", f"/list/{RUN}/%2e%2e"),
        ("GET", f"/files/{RUN}/link/secret"),
        ("DELETE", f"/files/{RUN}/%2e%2e"),
        ("DELETE", f"/files/{RUN}/link/secret"),
        ("HEAD", f"/files/{RUN}/../../secret"),
    ],
)
def test_paths_outside_the_root_are_refused(connected, tmp_path, method, path):
    peers, root = connected
    secret = tmp_path / "secret"
    secret.write_bytes(b"top secret")
    (root / "secret").write_bytes(b"top secret")  # next to the run directory
    (root / RUN / "link").symlink_to(tmp_path)
    response = _raw(
        peers.addresses[0],
        f"{method} {path} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {peers.token}\r\n\r\n".encode(),
    )
    assert 400 <= _status(response) < 500, response[:200]
    assert b"top secret" not in response
    assert secret.read_bytes() == b"top secret" and (root / "secret").exists()


def test_oversized_or_malformed_requests_are_refused(connected):
    peers, _ = connected
    address, token = peers.addresses[0], peers.token
    auth = f"Host: x\r\n{TOKEN_HEADER}: {token}\r\n"
    long_line = f"GET /files/{RUN}/{'a' * 70000} HTTP/1.1\r\n{auth}\r\n".encode()
    assert _status(_raw(address, long_line)) == 414
    many = "".join(f"X-H{i}: v\r\n" for i in range(120))
    assert (
        _status(_raw(address, f"GET /files/{RUN}/f HTTP/1.1\r\n{auth}{many}\r\n".encode())) == 431
    )
    no_length = f"POST /push/{RUN}/d HTTP/1.1\r\n{auth}Expect: 100-continue\r\n\r\n".encode()
    assert _status(_raw(address, no_length)) == 411
    # A push header claiming more bytes than the body holds is refused, not awaited.
    body = (10_000).to_bytes(4, "big") + b"{}"
    lying = (
        f"POST /push/{RUN}/d HTTP/1.1\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    start = time.monotonic()
    assert _status(_raw(address, lying)) == 400
    assert time.monotonic() - start < 2
