"""Tests for the peer data service (server and client in one process)."""

import dataclasses
import errno
import http.client
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jaxckpt.coord import _liveness
from jaxckpt.format import _checksum, _format
from jaxckpt.memory import _slab
from jaxckpt.peer import _client, _request_handler
from jaxckpt.peer._client import (
    delete_path,
    fetch_file,
    fetch_range,
    list_dir,
    push_part,
    redact_token,
)
from jaxckpt.peer._server import PeerServer
from jaxckpt.peer._wire import (
    TEMP_PREFIX,
    TOKEN_HEADER,
    PeerAddress,
    PushHeader,
    decode_push_header,
    encode_push_header,
    push_body_length,
)

TOKEN = "s3cret-token-value"
RUN = "run1"
TIMEOUT = 5.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "memory"


@pytest.fixture
def server(root: Path) -> Iterator[PeerServer]:
    with PeerServer(root, run_id=RUN, token=TOKEN) as srv:
        yield srv


def _kw(**overrides: object) -> dict:
    return {"token": TOKEN, "run_id": RUN, "timeout": TIMEOUT} | overrides


def _make_tree(base: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(data)
    return base


def _raw(server: PeerServer, method: str, path: str, headers: dict | None = None):
    conn = http.client.HTTPConnection(server.address.host, server.address.port, timeout=TIMEOUT)
    conn.request(method, path, headers={TOKEN_HEADER: TOKEN} | (headers or {}))
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp, body


def _temps(root: Path) -> list[str]:
    run_dir = root / RUN
    return [n for n in os.listdir(run_dir) if n.startswith(TEMP_PREFIX)]


def _wait_no_temps(root: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while _temps(root) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _temps(root) == []


def _place(step: int, owner: int = 0) -> str:
    return f"step_{step:012d}/part_{owner:05d}"


def _make_part(
    base: Path, step: int, chunks: list[bytes], *, owner: int = 0, run_id: str = RUN
) -> Path:
    """A memory-tier part as a save writes it: manifest.json and a slab of `chunks`."""
    base.mkdir(parents=True, exist_ok=True)
    offsets, size = _slab.layout([len(c) for c in chunks])
    arrays = [np.frombuffer(c, np.uint8) for c in chunks]
    crcs = _slab.write(base / _slab.SLAB_FILE, arrays, offsets, size)
    leaves = (
        _format.LeafRecord(path="['params']['w']", kind=_format.ARRAY, array_key="params.w"),
        _format.LeafRecord(path="['step']", kind=_format.SCALAR, value=step),
    )
    records = tuple(
        _format.ChunkRecord((i, 0), len(c), crc32c=crc, offset=off)
        for i, (c, (crc,), off) in enumerate(zip(chunks, crcs, offsets, strict=True))
    )
    manifest = _format.PartManifest(
        step=step,
        run_id=run_id,
        save_id=os.urandom(4).hex(),
        owner=owner,
        process_count=1,
        failure_domain="",
        leaves=leaves,
        chunks={0: records},
        iterator_states={},
        created=0.0,
    )
    (base / _format.MANIFEST_FILE).write_text(manifest.to_json())
    return base


def _assert_same_part(a: Path, b: Path) -> None:
    for name in (_format.MANIFEST_FILE, _slab.SLAB_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert sorted(os.listdir(b)) == sorted(os.listdir(a))


def _assert_part_intact(part: Path) -> None:
    """Every chunk of the part's slab matches its manifest."""
    manifest = _format.PartManifest.from_json((part / _format.MANIFEST_FILE).read_text())
    reader = _slab.Reader(part / _slab.SLAB_FILE)
    for cs in manifest.chunks.values():
        for c in cs:
            assert c.offset is not None
            assert _checksum.matches(c.crc32c, c.crc32, reader.view(c.offset, c.nbytes))


def _raw_push_prefix(server: PeerServer, dest: str, body_after_header: bytes, sizes: PushHeader):
    """Opens a push by hand; returns (socket, reader, full body)."""
    header = encode_push_header(sizes)
    body = len(header).to_bytes(4, "big") + header + body_after_header
    sock = socket.create_connection((server.address.host, server.address.port), timeout=TIMEOUT)
    sock.sendall(
        f"POST /push/{RUN}/{dest} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
        f"Content-Length: {push_body_length(len(header), sizes)}\r\n"
        "Expect: 100-continue\r\n\r\n".encode()
    )
    reader = sock.makefile("rb")
    assert reader.readline().split()[1] == b"100"
    assert reader.readline() == b"\r\n"
    return sock, reader, body


def _raw_push_of(server: PeerServer, part: Path, dest: str):
    manifest = (part / _format.MANIFEST_FILE).read_bytes()
    slab = (part / _slab.SLAB_FILE).read_bytes()
    return _raw_push_prefix(server, dest, manifest + slab, PushHeader(len(manifest), len(slab)))


def test_push_fetch_list_replace_round_trip(server: PeerServer, root: Path, tmp_path: Path) -> None:
    # Several receive steps, chunks of odd sizes (padding between them), an empty one.
    chunks = [os.urandom(9 << 20), os.urandom(12_345), b"", os.urandom(11 << 20)]
    src = _make_part(tmp_path / "src", 3, chunks)
    sent = push_part(server.address, part_dir=src, dest_relpath=_place(3), **_kw())
    assert sent == sum(os.path.getsize(src / n) for n in os.listdir(src))
    dest = root / RUN / _place(3)
    _assert_same_part(src, dest)
    manifest = fetch_file(server.address, relpath=f"{_place(3)}/manifest.json", **_kw())
    assert manifest == (src / "manifest.json").read_bytes()
    last = _format.PartManifest.from_json(manifest).chunks[0][3]
    assert last.offset is not None
    got = bytearray(1000)
    fetch_range(
        server.address,
        relpath=f"{_place(3)}/slab",
        offset=last.offset + 5,
        into=memoryview(got),
        **_kw(),
    )
    assert got == chunks[3][5:1005]
    size = (dest / "slab").stat().st_size
    with pytest.raises(OSError, match="answers with 10 bytes, not the 1000"):
        fetch_range(
            server.address,
            relpath=f"{_place(3)}/slab",
            offset=size - 10,
            into=memoryview(got),
            **_kw(),
        )
    assert list_dir(server.address, relpath=_place(3), **_kw()) == ["manifest.json", "slab"]
    assert list_dir(server.address, relpath="", **_kw()) == ["step_000000000003"]

    # A second push to the same destination replaces it as a whole.
    src2 = _make_part(tmp_path / "src2", 3, [b"new" * 1000])
    push_part(server.address, part_dir=src2, dest_relpath=_place(3), **_kw())
    _assert_same_part(src2, dest)
    _wait_no_temps(root)  # The replaced copy is freed just after the answer.

    delete_path(server.address, relpath=_place(3), **_kw())
    assert not dest.exists()
    with pytest.raises(FileNotFoundError, match=_place(3)):
        delete_path(server.address, relpath=_place(3), **_kw())
    with pytest.raises(FileNotFoundError, match=str(server.address)):
        fetch_file(server.address, relpath=f"{_place(3)}/slab", **_kw())
    assert _temps(root) == []


def test_push_of_an_empty_part(server: PeerServer, root: Path, tmp_path: Path) -> None:
    src = _make_part(tmp_path / "src", 4, [])
    push_part(server.address, part_dir=src, dest_relpath=_place(4), **_kw())
    _assert_same_part(src, root / RUN / _place(4))
    assert (root / RUN / _place(4) / "slab").stat().st_size == 0


@pytest.mark.parametrize("bigger", [True, False], ids=["free-slab-bigger", "free-slab-smaller"])
def test_push_is_received_into_a_free_slab_of_the_memory_tier(
    server: PeerServer, root: Path, tmp_path: Path, bigger: bool
) -> None:
    free = root / RUN / ".free"
    free.mkdir(parents=True)
    (free / "slab-1").write_bytes(b"\xee" * ((3 << 20) if bigger else 1000))
    inode = (free / "slab-1").stat().st_ino
    src = _make_part(tmp_path / "src", 5, [os.urandom(1 << 20), os.urandom(777)])
    push_part(server.address, part_dir=src, dest_relpath=_place(5), **_kw())
    dest = root / RUN / _place(5)
    assert (dest / "slab").stat().st_ino == inode  # the free slab, refilled
    assert list(free.iterdir()) == []
    _assert_same_part(src, dest)  # resized to the pushed slab: no stale tail


def test_a_free_slab_received_into_stays_mapped_for_the_next_push(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    """The holder maps a free slab once: retired (back to `.free/`) and refilled by the
    next push, it is received into through the same mapping, with the new bytes."""
    free = root / RUN / ".free"
    free.mkdir(parents=True)
    (free / "slab-1").write_bytes(b"\xee" * (2 << 20))
    st = (free / "slab-1").stat()
    key = (st.st_dev, st.st_ino)
    push_part(
        server.address,
        part_dir=_make_part(tmp_path / "src", 5, [os.urandom(1 << 20)]),
        dest_relpath=_place(5),
        **_kw(),
    )
    mapping = _slab._KEPT[key].mapping
    os.rename(root / RUN / _place(5) / "slab", free / "slab-2")  # retired, as `recycle` does
    src = _make_part(tmp_path / "src2", 6, [os.urandom(1 << 20)])
    push_part(server.address, part_dir=src, dest_relpath=_place(6), **_kw())
    assert (root / RUN / _place(6) / "slab").stat().st_ino == key[1]
    assert _slab._KEPT[key].mapping is mapping
    _assert_same_part(src, root / RUN / _place(6))
    _slab.forget_all()


def test_a_service_told_not_to_reuse_slabs_leaves_them(root: Path, tmp_path: Path) -> None:
    free = root / RUN / ".free"
    free.mkdir(parents=True)
    (free / "slab-1").write_bytes(b"\xee" * 4096)
    src = _make_part(tmp_path / "src", 5, [os.urandom(5000)])
    with PeerServer(root, run_id=RUN, token=TOKEN, reuse_free_slabs=False) as srv:
        push_part(srv.address, part_dir=src, dest_relpath=_place(5), **_kw())
    assert [p.name for p in free.iterdir()] == ["slab-1"]
    _assert_same_part(src, root / RUN / _place(5))


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh-file", "free-slab"])
@pytest.mark.parametrize("where", [0, -1], ids=["first-chunk", "last-chunk"])
def test_push_damaged_in_flight_is_refused_and_leaves_the_old_copy(
    server: PeerServer,
    root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reuse: bool,
    where: int,
) -> None:
    old = _make_part(tmp_path / "old", 6, [b"old" * 100])
    push_part(server.address, part_dir=old, dest_relpath=_place(6), **_kw())
    if reuse:
        (root / RUN / ".free").mkdir()
        (root / RUN / ".free" / "slab-1").write_bytes(bytes(1 << 20))
    new = _make_part(tmp_path / "new", 6, [os.urandom(3 << 20), os.urandom(10_000)])
    chunk = _format.PartManifest.from_json((new / "manifest.json").read_text()).chunks[0][where]
    assert chunk.offset is not None
    flip_at = chunk.offset + chunk.nbytes // 2
    original = _client._send_file

    def send_damaged(sock, f, size):  # the sender's bytes, one bit flipped on the way
        if not f.name.endswith("slab"):
            return original(sock, f, size)
        data = bytearray(f.read())
        data[flip_at] ^= 0x10
        sock.sendall(data)

    monkeypatch.setattr(_client, "_send_file", send_damaged)
    with pytest.raises(OSError, match="400") as err:
        push_part(server.address, part_dir=new, dest_relpath=_place(6), **_kw())
    assert err.value.errno == errno.EINVAL
    message = str(err.value)
    assert f"Chunk {list(chunk.index)} of leaf \"['params']['w']\"" in message, message
    assert f"bytes [{chunk.offset}, {chunk.offset + chunk.nbytes})" in message
    assert "damaged in transit" in message
    _assert_same_part(old, root / RUN / _place(6))  # nothing of the bad push is visible
    _wait_no_temps(root)

    monkeypatch.setattr(_client, "_send_file", original)  # the next push goes through
    push_part(server.address, part_dir=new, dest_relpath=_place(6), **_kw())
    _assert_same_part(new, root / RUN / _place(6))


def test_push_of_a_part_without_a_manifest_or_slab_is_refused(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    src = _make_part(tmp_path / "src", 7, [b"x" * 100])
    (src / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        push_part(server.address, part_dir=src, dest_relpath=_place(7), **_kw())
    src = _make_part(tmp_path / "src2", 7, [b"x" * 100])
    (src / "slab").unlink()
    with pytest.raises(FileNotFoundError, match="slab"):
        push_part(server.address, part_dir=src, dest_relpath=_place(7), **_kw())
    assert not (root / RUN / "step_000000000007").exists()


def _garbage(text: str) -> str:
    return text[: len(text) // 2]


def _other_run(text: str) -> str:
    return dataclasses.replace(_format.PartManifest.from_json(text), run_id="another-run").to_json()


def _other_step(text: str) -> str:
    return dataclasses.replace(_format.PartManifest.from_json(text), step=8).to_json()


def _chunk_past_the_slab(text: str) -> str:
    m = _format.PartManifest.from_json(text)
    (c,) = m.chunks[0]
    bad = dataclasses.replace(c, offset=(8 << 20) - 10)
    return dataclasses.replace(m, chunks={0: (bad,)}).to_json()


def _no_offsets(text: str) -> str:  # as in a manifest of format version 2: no slab
    m = _format.PartManifest.from_json(text)
    chunks = {
        i: tuple(dataclasses.replace(c, offset=None) for c in cs) for i, cs in m.chunks.items()
    }
    return dataclasses.replace(m, chunks=chunks).to_json()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_garbage, "is not a valid part manifest"),
        (lambda text: text.replace('"step":7', '"step":9'), "does not match its checksum"),
        (_other_run, "run 'another-run'"),
        (_other_step, "belongs at 'step_000000000008/part_00000'"),
        (_chunk_past_the_slab, "lies outside the pushed 8388608-byte slab"),
        (_no_offsets, "has no place in a slab"),
    ],
    ids=["garbage", "checksum", "other-run", "other-place", "past-the-slab", "no-offsets"],
)
def test_push_with_a_bad_manifest_is_refused_with_a_clear_answer(
    server: PeerServer, root: Path, tmp_path: Path, damage, message: str
) -> None:
    # A large slab: the refusal comes before the server reads it, and still reaches
    # the pusher (which sends the whole body first) instead of a reset connection.
    src = _make_part(tmp_path / "src", 7, [os.urandom(8 << 20)])
    manifest = src / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    for _ in range(3):
        with pytest.raises(OSError, match="400") as err:
            push_part(server.address, part_dir=src, dest_relpath=_place(7), **_kw())
        assert err.value.errno == errno.EINVAL
        assert message in str(err.value)
    assert not (root / RUN / "step_000000000007").exists()
    _wait_no_temps(root)


def test_push_when_the_holder_is_out_of_memory_is_refused_cleanly(
    server: PeerServer, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    src = _make_part(tmp_path / "src", 7, [os.urandom(4 << 20)])
    monkeypatch.setattr(_request_handler.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="507") as err:
        push_part(server.address, part_dir=src, dest_relpath=_place(7), **_kw())
    assert err.value.errno == errno.ENOSPC
    assert not (root / RUN / "step_000000000007").exists()
    _wait_no_temps(root)


def test_get_supports_range_head_and_etag(server: PeerServer, root: Path) -> None:
    _make_tree(root / RUN, {"f.bin": bytes(range(100))})
    resp, body = _raw(server, "GET", f"/files/{RUN}/f.bin", {"Range": "bytes=2-5"})
    assert (resp.status, body, resp.headers["Content-Range"]) == (
        206,
        bytes([2, 3, 4, 5]),
        "bytes 2-5/100",
    )
    resp, body = _raw(server, "GET", f"/files/{RUN}/f.bin", {"Range": "bytes=-3"})
    assert (resp.status, body) == (206, bytes([97, 98, 99]))
    resp, body = _raw(server, "GET", f"/files/{RUN}/f.bin", {"Range": "bytes=95-"})
    assert (resp.status, body) == (206, bytes(range(95, 100)))
    resp, body = _raw(server, "GET", f"/files/{RUN}/f.bin", {"Range": "bytes=100-"})
    assert resp.status == 416
    resp, body = _raw(server, "HEAD", f"/files/{RUN}/f.bin")
    assert (resp.status, body, resp.headers["Content-Length"]) == (200, b"", "100")
    etag = resp.headers["ETag"]
    resp, body = _raw(server, "GET", f"/files/{RUN}/f.bin", {"If-None-Match": etag})
    assert (resp.status, body) == (304, b"")
    resp, _ = _raw(server, "GET", f"/files/{RUN}/f.bin", {"If-Match": '"other"'})
    assert resp.status == 412
    resp, _ = _raw(server, "GET", f"/files/{RUN}/missing")
    assert resp.status == 404


def test_wrong_or_missing_token_is_rejected(server: PeerServer, root: Path, tmp_path: Path) -> None:
    _make_tree(root / RUN, {"f.bin": b"secret data"})
    with pytest.raises(PermissionError, match="403"):
        fetch_file(server.address, relpath="f.bin", **_kw(token="wrong"))
    conn = http.client.HTTPConnection(server.address.host, server.address.port, timeout=TIMEOUT)
    conn.request("GET", f"/files/{RUN}/f.bin")
    resp = conn.getresponse()
    assert resp.status == 403
    assert b"secret data" not in resp.read()
    src = _make_part(tmp_path / "src", 1, [b"1"])
    with pytest.raises(PermissionError):
        push_part(server.address, part_dir=src, dest_relpath=_place(1), **_kw(token="wrong"))
    assert not (root / RUN / "step_000000000001").exists()


def test_other_run_id_is_rejected(server: PeerServer, root: Path) -> None:
    _make_tree(root / RUN, {"f.bin": b"x"})
    with pytest.raises(OSError, match=r"serves run 'run1', not run 'run2'") as err:
        fetch_file(server.address, relpath="f.bin", **_kw(run_id="run2"))
    assert err.value.errno == errno.ESTALE
    resp, _ = _raw(server, "GET", "/files/run2/f.bin")
    assert resp.status == 409


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../b", "a\x00b", "a//b", "./a"])
def test_client_refuses_escaping_paths(server: PeerServer, bad: str) -> None:
    with pytest.raises(ValueError):
        fetch_file(server.address, relpath=bad, **_kw())


@pytest.mark.parametrize(
    "path",
    [
        f"/files/{RUN}/../../etc/passwd",
        f"/files/{RUN}/%2e%2e/x",
        f"/files/{RUN}//etc/passwd",
        f"/files/{RUN}/a%00b",
        f"/list/{RUN}/..",
    ],
)
def test_server_refuses_escaping_paths(server: PeerServer, path: str) -> None:
    resp, _ = _raw(server, "GET", path)
    assert resp.status == 400


@pytest.mark.parametrize(
    "dest", ["link/part_00000", "d", "step_000000000001", f"{TEMP_PREFIX}x/part_00000"]
)
def test_server_refuses_symlink_escape_and_bad_push_destinations(
    server: PeerServer, root: Path, tmp_path: Path, dest: str
) -> None:
    outside = _make_tree(tmp_path / "outside", {"secret": b"no"})
    os.symlink(outside, root / RUN / "link")
    resp, _ = _raw(server, "GET", f"/files/{RUN}/link/secret")
    assert resp.status == 400
    # A push that is not to a part's place (or leaves the run directory through a
    # symlink) is refused before its body moves.
    os.symlink(outside, root / RUN / "step_000000000002")
    for place in (dest, "step_000000000002/part_00000"):
        sock = socket.create_connection((server.address.host, server.address.port), timeout=TIMEOUT)
        with sock, sock.makefile("rb") as reader:
            sock.sendall(
                f"POST /push/{RUN}/{place} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
                "Content-Length: 100\r\nExpect: 100-continue\r\n\r\n".encode()
            )
            assert reader.readline().split()[1] == b"400", place
    assert sorted(os.listdir(outside)) == ["secret"]
    assert sorted(os.listdir(root / RUN)) == ["link", "step_000000000002"]


def test_oversized_push_is_refused_before_the_body(root: Path, tmp_path: Path) -> None:
    with PeerServer(root, run_id=RUN, token=TOKEN, max_push_bytes=1000) as srv:
        src = _make_part(tmp_path / "src", 1, [os.urandom(64 << 20)])
        start = time.monotonic()
        with pytest.raises(OSError, match="413") as err:
            push_part(srv.address, part_dir=src, dest_relpath=_place(1), **_kw())
        assert err.value.errno == errno.EFBIG
        assert time.monotonic() - start < 2.0  # Refused at the headers, not after 64 MB.
        assert not (root / RUN / "step_000000000001").exists()
        assert _temps(root) == []


def test_a_replaced_part_gives_its_slab_to_the_free_slabs(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    first = _make_part(tmp_path / "first", 1, [os.urandom(1 << 20)])
    push_part(server.address, part_dir=first, dest_relpath=_place(1), **_kw())
    replaced = (root / RUN / _place(1) / "slab").stat().st_ino
    second = _make_part(tmp_path / "second", 1, [os.urandom(1 << 20)])
    push_part(server.address, part_dir=second, dest_relpath=_place(1), **_kw())
    _assert_same_part(second, root / RUN / _place(1))
    _wait_no_temps(root)  # the replaced part is retired just after the answer
    free = list((root / RUN / ".free").iterdir())
    assert [p.stat().st_ino for p in free] == [replaced]
    third = _make_part(tmp_path / "third", 1, [os.urandom(1 << 20)])
    push_part(server.address, part_dir=third, dest_relpath=_place(1), **_kw())
    assert (root / RUN / _place(1) / "slab").stat().st_ino == replaced  # received into it
    _assert_same_part(third, root / RUN / _place(1))


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh-file", "free-slab"])
def test_interrupted_push_leaves_old_copy_and_no_partial(
    server: PeerServer, root: Path, tmp_path: Path, reuse: bool
) -> None:
    old = _make_part(tmp_path / "old", 1, [b"old"])
    push_part(server.address, part_dir=old, dest_relpath=_place(1), **_kw())
    if reuse:
        (root / RUN / ".free").mkdir()
        (root / RUN / ".free" / "slab-1").write_bytes(bytes(1 << 20))
    new = _make_part(tmp_path / "new", 1, [os.urandom(3 << 20), os.urandom(100)])
    handled = server.handled
    sock, reader, body = _raw_push_of(server, new, _place(1))
    with sock, reader:
        sock.sendall(body[: len(body) // 2])
    # The server may not even have accepted the connection yet: wait until it is done.
    deadline = time.monotonic() + TIMEOUT
    while server.handled == handled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.handled > handled
    assert _temps(root) == []
    _assert_same_part(old, root / RUN / _place(1))


def test_push_whose_slab_does_not_match_is_refused_by_a_raw_client(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    src = _make_part(tmp_path / "src", 1, [b"payload" * 100])
    sock, reader, body = _raw_push_of(server, src, _place(1))
    damaged = bytearray(body)
    damaged[-100] ^= 1  # inside the chunk, past its alignment padding
    with sock, reader:
        sock.sendall(damaged)
        status_line = reader.readline()
    assert status_line.split()[1] == b"400"
    assert not (root / RUN / "step_000000000001").exists()
    _wait_no_temps(root)


def test_push_header_that_lies_about_the_body_is_refused(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    src = _make_part(tmp_path / "src", 1, [b"payload" * 100])
    manifest = (src / "manifest.json").read_bytes()
    slab = (src / "slab").read_bytes()
    header = encode_push_header(PushHeader(len(manifest), len(slab) + 10))  # 10 bytes too many
    body = len(header).to_bytes(4, "big") + header + manifest + slab
    sock = socket.create_connection((server.address.host, server.address.port), timeout=TIMEOUT)
    with sock, sock.makefile("rb") as reader:
        sock.sendall(
            f"POST /push/{RUN}/{_place(1)} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert reader.readline().split()[1] == b"400"
    assert not (root / RUN / "step_000000000001").exists()


def test_concurrent_pushes_to_one_destination_stay_whole(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    sources = [
        _make_part(tmp_path / f"src{i}", 1, [bytes([i]) * 50_000 for _ in range(4)])
        for i in range(6)
    ]
    threads = [
        threading.Thread(
            target=push_part,
            args=(server.address,),
            kwargs=_kw(part_dir=s, dest_relpath=_place(1)),
        )
        for s in sources
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dest = root / RUN / _place(1)
    # Manifest and slab come from the same push.
    assert any(
        (dest / "manifest.json").read_bytes() == (s / "manifest.json").read_bytes() for s in sources
    )
    _assert_part_intact(dest)
    _wait_no_temps(root)


def test_stopped_server_fails_fast(root: Path) -> None:
    srv = PeerServer(root, run_id=RUN, token=TOKEN)
    srv.start()
    address = srv.address
    srv.close()
    srv.close()  # Idempotent.
    with pytest.raises(RuntimeError, match="closed"):
        srv.start()
    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match=str(address)):
        fetch_file(address, relpath="f", **_kw(timeout=2.0))
    assert time.monotonic() - start < 2.0


def test_silent_peer_times_out_within_the_timeout(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # Accepts (backlog), never answers.
    address = PeerAddress("127.0.0.1", listener.getsockname()[1])
    src = _make_part(tmp_path / "src", 1, [b"x"])
    try:
        for call in (
            lambda: fetch_file(address, relpath="manifest.json", **_kw(timeout=0.3)),
            lambda: list_dir(address, relpath="", **_kw(timeout=0.3)),
            lambda: push_part(address, part_dir=src, dest_relpath=_place(1), **_kw(timeout=0.3)),
        ):
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"{address}.*0\.3 s"):
                call()
            assert 0.25 < time.monotonic() - start < 1.5
    finally:
        listener.close()


def test_stalled_client_is_dropped_and_close_does_not_hang(root: Path) -> None:
    srv = PeerServer(root, run_id=RUN, token=TOKEN, io_timeout=0.3)
    srv.start()
    stalled = socket.create_connection((srv.address.host, srv.address.port), timeout=TIMEOUT)
    stalled.sendall(b"GET /files/run1/x HTTP/1.1\r\n")  # Never finishes its headers.
    start = time.monotonic()
    assert stalled.recv(100) == b""  # The server hung up on it.
    assert time.monotonic() - start < 2.0
    idle = socket.create_connection((srv.address.host, srv.address.port), timeout=TIMEOUT)
    time.sleep(0.05)
    start = time.monotonic()
    srv.close()
    assert time.monotonic() - start < 2.0
    stalled.close()
    idle.close()


def test_stale_temps_of_dead_processes_are_removed_on_start(root: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    # Records as `_liveness.record` writes them: pid.start.pid-namespace.boot
    here = _liveness.record().split(".", 2)[2]
    stale = root / RUN / f"{TEMP_PREFIX}{dead.stdout.strip()}.1.{here}-push-abc"
    mine = root / RUN / f"{TEMP_PREFIX}{_liveness.record()}-push-def"
    stale.mkdir(parents=True)
    mine.mkdir()
    with PeerServer(root, run_id=RUN, token=TOKEN):
        assert not stale.exists()
        assert mine.exists()


def test_token_is_never_logged(
    server: PeerServer, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="jaxckpt")
    _make_tree(root / RUN, {"f": b"x"})
    fetch_file(server.address, relpath="f", **_kw())
    with pytest.raises(PermissionError) as err:
        fetch_file(server.address, relpath="f", **_kw(token="wrong-" + TOKEN))
    assert "peer service" in caplog.text
    assert TOKEN not in caplog.text
    assert TOKEN not in str(err.value)


def test_argument_validation() -> None:
    assert PeerAddress.from_dict(PeerAddress("10.0.0.2", 8470).to_dict()) == PeerAddress(
        "10.0.0.2", 8470
    )
    assert str(PeerAddress("::1", 80)) == "[::1]:80"
    with pytest.raises(ValueError, match="port"):
        PeerAddress("h", 0)
    with pytest.raises(ValueError, match="run_id"):
        PeerServer("/tmp", run_id="../x", token=TOKEN)
    with pytest.raises(ValueError, match="token"):
        PeerServer("/tmp", run_id=RUN, token="bad\r\ntoken")
    with pytest.raises(ValueError, match="max_push_bytes"):
        PeerServer("/tmp", run_id=RUN, token=TOKEN, max_push_bytes=0)
    assert redact_token(f"spec with {TOKEN} in it", TOKEN) == "spec with <redacted> in it"
    assert redact_token("text", "") == "text"


def test_push_header_round_trip_and_rejections() -> None:
    sizes = PushHeader(manifest_bytes=3, slab_bytes=0)
    header = encode_push_header(sizes)
    assert decode_push_header(header) == sizes
    assert push_body_length(len(header), sizes) == 4 + len(header) + 3
    bad = {
        b"not json": "Malformed push header",
        b'{"manifest_bytes": 1, "slab_bytes": 1}': "Malformed push header",
        b'{"version": 1, "files": []}': "version 1 unsupported",
        b'{"version": 2, "slab_bytes": 1}': "Malformed push header",
        b'{"version": 2, "manifest_bytes": -1, "slab_bytes": 1}': "non-negative ints",
        b'{"version": 2, "manifest_bytes": true, "slab_bytes": 1}': "non-negative ints",
        b'{"version": 2, "manifest_bytes": 1, "slab_bytes": "1"}': "non-negative ints",
        b"[2]": "Malformed push header",
    }
    for data, message in bad.items():
        with pytest.raises(ValueError, match=message):
            decode_push_header(data)


def test_a_request_before_the_runs_token_is_told_waits_for_it(root: Path) -> None:
    """The set-up starts each service before the run's token is exchanged: a peer that
    learned it first (and pushes at once) is answered once this service learns it too,
    and a wrong token, or none told within the I/O timeout, is refused."""
    (root / RUN).mkdir(parents=True)
    (root / RUN / "f").write_bytes(b"data")
    with PeerServer(root, run_id=RUN, token=None, io_timeout=1.0) as srv:
        got: list[object] = []
        reader = threading.Thread(
            target=lambda: got.append(fetch_file(srv.address, relpath="f", **_kw()))
        )
        reader.start()
        time.sleep(0.3)
        assert reader.is_alive() and got == []  # waiting for the token
        srv.set_token(TOKEN)
        reader.join(10)
        assert got == [b"data"]
        with pytest.raises(PermissionError):
            fetch_file(srv.address, relpath="f", **_kw(token="another-token-value"))
    never_told = PeerServer(root, run_id=RUN, token=None, io_timeout=0.5)
    with never_told as srv, pytest.raises(PermissionError):  # refused after the I/O timeout
        fetch_file(srv.address, relpath="f", **_kw())
    made_with_one = PeerServer(root, run_id=RUN, token=TOKEN)
    with made_with_one as srv, pytest.raises(ValueError, match="made with its token"):
        srv.set_token(TOKEN)
