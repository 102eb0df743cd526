"""Tests for the peer data service (server and client in one process)."""

import errno
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from jaxckpt import _liveness
from jaxckpt.peer._client import (
    delete_path,
    fetch_file,
    http_kvstore_spec,
    list_dir,
    push_directory,
    redact_token,
)
from jaxckpt.peer._server import PeerServer
from jaxckpt.peer._wire import (
    TEMP_PREFIX,
    TOKEN_HEADER,
    PeerAddress,
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


def _raw_push_prefix(server: PeerServer, dest: str, files: list[tuple[str, bytes]], crc_delta=0):
    """Opens a push by hand; returns (socket, reader, full body)."""
    header = json.dumps(
        {"version": 1, "files": [{"path": n, "size": len(d)} for n, d in files]}
    ).encode()
    body = len(header).to_bytes(4, "big") + header
    for _, data in files:
        body += data + ((zlib.crc32(data) + crc_delta) & 0xFFFFFFFF).to_bytes(4, "big")
    sock = socket.create_connection((server.address.host, server.address.port), timeout=TIMEOUT)
    sock.sendall(
        f"POST /push/{RUN}/{dest} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    reader = sock.makefile("rb")
    assert reader.readline().split()[1] == b"100"
    assert reader.readline() == b"\r\n"
    return sock, reader, body


def test_push_fetch_list_replace_round_trip(server: PeerServer, root: Path, tmp_path: Path) -> None:
    big = os.urandom(20 << 20)  # Several transfer buffers.
    src = _make_tree(
        tmp_path / "src",
        {"manifest.json": b'{"step": 3}', "a/c/0/0": big, "a/zarr.json": b"{}", "empty": b""},
    )
    sent = push_directory(server.address, src_dir=src, dest_relpath="replicas/p0/step_3", **_kw())
    assert sent == len(big) + 2 + 11 + 0
    dest = root / RUN / "replicas/p0/step_3"
    assert (dest / "a/c/0/0").read_bytes() == big
    assert fetch_file(server.address, relpath="replicas/p0/step_3/manifest.json", **_kw()) == (
        b'{"step": 3}'
    )
    assert fetch_file(server.address, relpath="replicas/p0/step_3/empty", **_kw()) == b""
    names = list_dir(server.address, relpath="replicas/p0/step_3", **_kw())
    assert names == ["a", "empty", "manifest.json"]
    assert list_dir(server.address, relpath="", **_kw()) == ["replicas"]

    # A second push to the same destination replaces it as a whole.
    src2 = _make_tree(tmp_path / "src2", {"only.txt": b"new"})
    push_directory(server.address, src_dir=src2, dest_relpath="replicas/p0/step_3", **_kw())
    assert sorted(os.listdir(dest)) == ["only.txt"]
    _wait_no_temps(root)  # The replaced copy is freed just after the answer.

    delete_path(server.address, relpath="replicas/p0/step_3", **_kw())
    assert not dest.exists()
    with pytest.raises(FileNotFoundError, match="replicas/p0/step_3"):
        delete_path(server.address, relpath="replicas/p0/step_3", **_kw())
    with pytest.raises(FileNotFoundError, match=str(server.address)):
        fetch_file(server.address, relpath="replicas/p0/step_3/only.txt", **_kw())
    assert _temps(root) == []


def test_tensorstore_reads_zarr3_through_http_kvstore(server: PeerServer, tmp_path: Path) -> None:
    """The restore path: tensorstore reads a peer's zarr3 chunks straight over HTTP."""
    data = np.arange(96 * 40, dtype=np.float32).reshape(96, 40) * 0.5
    src = tmp_path / "snapshot"
    written = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(src / "params.w") + "/"},
            "metadata": {
                "shape": list(data.shape),
                "data_type": "float32",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [32, 40]}},
            },
        },
        create=True,
    ).result()
    written.write(data).result()
    push_directory(server.address, src_dir=src, dest_relpath="replicas/p1/step_9", **_kw())

    kvstore = http_kvstore_spec(server.address, TOKEN, RUN) | {
        "path": "replicas/p1/step_9/params.w/"
    }
    remote = ts.open({"driver": "zarr3", "kvstore": kvstore}, read=True).result()
    assert remote.shape == data.shape
    np.testing.assert_array_equal(remote.read().result(), data)
    np.testing.assert_array_equal(remote[17:70, 3:9].read().result(), data[17:70, 3:9])

    wrong = dict(kvstore, headers=[f"{TOKEN_HEADER}: wrong"])
    with pytest.raises(ValueError, match="403"):
        ts.open({"driver": "zarr3", "kvstore": wrong}, read=True).result()

    # tensorstore quotes the spec, token included, in its errors.
    missing = dict(kvstore, path="replicas/p1/step_9/absent/")
    with pytest.raises(ValueError) as err:
        ts.open({"driver": "zarr3", "kvstore": missing}, read=True).result()
    assert "NOT_FOUND" in str(err.value)
    assert TOKEN not in redact_token(str(err.value), TOKEN)


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
    src = _make_tree(tmp_path / "src", {"x": b"1"})
    with pytest.raises(PermissionError):
        push_directory(server.address, src_dir=src, dest_relpath="d", **_kw(token="wrong"))
    assert not (root / RUN / "d").exists()


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


def test_server_refuses_symlink_escape_and_bad_push_paths(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    outside = _make_tree(tmp_path / "outside", {"secret": b"no"})
    os.symlink(outside, root / RUN / "link")
    resp, _ = _raw(server, "GET", f"/files/{RUN}/link/secret")
    assert resp.status == 400
    sock, reader, body = _raw_push_prefix(server, "dest", [("../evil", b"x")])
    with sock, reader:
        sock.sendall(body)
        assert reader.readline().split()[1] == b"400"
    assert not (root / RUN / "dest").exists()
    assert not (root / "evil").exists()
    _wait_no_temps(root)


def test_oversized_push_is_refused_before_the_body(root: Path, tmp_path: Path) -> None:
    with PeerServer(root, run_id=RUN, token=TOKEN, max_push_bytes=1000) as srv:
        src = _make_tree(tmp_path / "src", {"big": os.urandom(64 << 20)})
        start = time.monotonic()
        with pytest.raises(OSError, match="413") as err:
            push_directory(srv.address, src_dir=src, dest_relpath="d", **_kw())
        assert err.value.errno == errno.EFBIG
        assert time.monotonic() - start < 2.0  # Refused at the headers, not after 64 MB.
        assert not (root / RUN / "d").exists()
        assert _temps(root) == []


def test_interrupted_push_leaves_old_copy_and_no_partial(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    src = _make_tree(tmp_path / "src", {"a": b"old"})
    push_directory(server.address, src_dir=src, dest_relpath="step", **_kw())
    sock, reader, body = _raw_push_prefix(server, "step", [("a", b"n" * 100_000), ("b", b"x" * 10)])
    with sock, reader:
        sock.sendall(body[: len(body) // 2])
    _wait_no_temps(root)
    assert sorted(os.listdir(root / RUN / "step")) == ["a"]
    assert (root / RUN / "step" / "a").read_bytes() == b"old"


def test_corrupted_push_is_refused(server: PeerServer, root: Path) -> None:
    sock, reader, body = _raw_push_prefix(server, "step", [("a", b"payload")], crc_delta=1)
    with sock, reader:
        sock.sendall(body)
        status_line = reader.readline()
    assert status_line.split()[1] == b"400"
    assert not (root / RUN / "step").exists()
    _wait_no_temps(root)


def test_concurrent_pushes_to_one_destination_stay_whole(
    server: PeerServer, root: Path, tmp_path: Path
) -> None:
    sources = [
        _make_tree(tmp_path / f"src{i}", {f"f{j}": bytes([i]) * 50_000 for j in range(4)})
        for i in range(6)
    ]
    threads = [
        threading.Thread(
            target=push_directory,
            args=(server.address,),
            kwargs=_kw(src_dir=s, dest_relpath="step"),
        )
        for s in sources
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    contents = {(root / RUN / "step" / f"f{j}").read_bytes() for j in range(4)}
    assert len(contents) == 1  # All four files come from the same push.
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
    src = _make_tree(tmp_path / "src", {"a": b"x"})
    try:
        for call in (
            lambda: fetch_file(address, relpath="manifest.json", **_kw(timeout=0.3)),
            lambda: list_dir(address, relpath="", **_kw(timeout=0.3)),
            lambda: push_directory(address, src_dir=src, dest_relpath="d", **_kw(timeout=0.3)),
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
    spec = http_kvstore_spec(PeerAddress("h", 1), TOKEN, RUN)
    assert spec == {
        "driver": "http",
        "base_url": "http://h:1/files/run1/",
        "headers": [f"{TOKEN_HEADER}: {TOKEN}"],
    }


def test_push_header_round_trip_and_rejections() -> None:
    files = [("a/b", 3), ("c", 0)]
    header = encode_push_header(files)
    assert decode_push_header(header) == files
    assert push_body_length(len(header), files) == 4 + len(header) + 3 + 4 + 0 + 4
    bad = {
        b"not json": "Malformed push header",
        b'{"files": []}': "Malformed push header",
        b'{"version": 2, "files": []}': "version 2 unsupported",
        b'{"version": 1, "files": [{"path": "../x", "size": 1}]}': "Malformed push header",
        b'{"version": 1, "files": [{"path": "x", "size": -1}]}': "non-negative ints",
        b'{"version": 1, "files": [{"path": "x", "size": true}]}': "non-negative ints",
        b'{"version": 1, "files": [{"path": "x", "size": 1}, {"path": "x/", "size": 1}]}': "twice",
    }
    for data, message in bad.items():
        with pytest.raises(ValueError, match=message):
            decode_push_header(data)
