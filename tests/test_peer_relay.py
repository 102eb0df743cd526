"""Tests for the relay store over the peer data service (server and client in one process)."""

import http.client
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxckpt.coord import _kv
from jaxckpt.peer._relay_client import ANSWER_MARGIN_S, RelayClient
from jaxckpt.peer._server import PeerServer
from jaxckpt.peer._wire import RELAY_MAX_KEY_BYTES, TOKEN_HEADER, check_relay_key

TOKEN = "s3cret-token-value"
RUN = "run1"
TIMEOUT = 5.0
KEY = "jaxckpt/save/run-x/5/0/v/3"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PeerServer]:
    with PeerServer(tmp_path / "memory", run_id=RUN, token=TOKEN) as srv:
        yield srv


def _client(server: PeerServer, **overrides: object) -> RelayClient:
    kw: dict = {"token": TOKEN, "run_id": RUN, "timeout": TIMEOUT} | overrides
    return RelayClient(server.address, **kw)


def _raw(server: PeerServer, method: str, path: str, body: bytes | None = None):
    conn = http.client.HTTPConnection(server.address.host, server.address.port, timeout=TIMEOUT)
    conn.request(method, path, body=body, headers={TOKEN_HEADER: TOKEN})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_set_then_get_and_values_round_trip(server: PeerServer) -> None:
    client = _client(server)
    values = {
        KEY: "plain",
        "k/newlines": "a\nb\r\n\nc\n",
        "k/unicode": "ünï©ødé ✓ 日本語 \U0001f600",
        "k/empty": "",
        "k/big": "x\n" * (1 << 19),  # 1 MiB
        "k/odd ?#%&=+ chars": "v",
    }
    for key, value in values.items():
        client.key_value_set(key, value)
    for key, value in values.items():
        assert client.blocking_key_value_get(key, 1000) == value
        assert server.relay_store.blocking_key_value_get(key, 0) == value


def test_the_served_store_is_the_leaders_own(server: PeerServer) -> None:
    client = _client(server)
    server.relay_store.key_value_set("in/process", "from the leader")
    assert client.blocking_key_value_get("in/process", 1000) == "from the leader"
    client.key_value_set("over/http", "from a member")
    assert server.relay_store.blocking_key_value_get("over/http", 0) == "from a member"


def test_get_waits_for_a_later_set(server: PeerServer) -> None:
    client = _client(server)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(client.blocking_key_value_get(KEY, 5000)))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive() and got == []
    _client(server).key_value_set(KEY, "later")
    reader.join(5)
    assert got == ["later"]


def test_get_times_out_with_deadline_exceeded(server: PeerServer) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=_kv.DEADLINE_EXCEEDED) as info:
        _client(server).blocking_key_value_get(KEY, 200)
    assert time.monotonic() - start < 3.0
    assert str(server.address) in str(info.value)
    with pytest.raises(RuntimeError, match=_kv.DEADLINE_EXCEEDED):
        _client(server).blocking_key_value_get(KEY, 0)


def test_a_wait_longer_than_the_services_bound_is_asked_for_again(tmp_path: Path) -> None:
    with PeerServer(tmp_path, run_id=RUN, token=TOKEN, io_timeout=0.3) as srv:
        client = _client(srv)
        threading.Timer(0.8, lambda: srv.relay_store.key_value_set(KEY, "late")).start()
        assert client.blocking_key_value_get(KEY, 3000) == "late"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=_kv.DEADLINE_EXCEEDED):
            client.blocking_key_value_get("never", 700)
        assert 0.6 < time.monotonic() - start < 3.0


def test_set_refuses_to_overwrite_unless_asked(server: PeerServer) -> None:
    client = _client(server)
    client.key_value_set(KEY, "first")
    with pytest.raises(RuntimeError, match=_kv.ALREADY_EXISTS):
        client.key_value_set(KEY, "second")
    assert client.blocking_key_value_get(KEY, 0) == "first"
    client.key_value_set(KEY, "second", allow_overwrite=True)
    assert client.blocking_key_value_get(KEY, 0) == "second"


def test_dir_get_and_delete(server: PeerServer) -> None:
    client = _client(server)
    for key, value in [("a/1", "x"), ("a/2", "y"), ("a/b/3", "z"), ("a", "top"), ("ab/4", "w")]:
        client.key_value_set(key, value)
    assert client.key_value_dir_get("a") == [("a/1", "x"), ("a/2", "y"), ("a/b/3", "z")]
    assert client.key_value_dir_get("a/") == client.key_value_dir_get("a")
    assert client.key_value_dir_get("nothing") == []
    client.key_value_delete("a/b")
    assert client.key_value_dir_get("a") == [("a/1", "x"), ("a/2", "y")]
    client.key_value_delete("a")
    assert client.key_value_dir_get("a") == []
    with pytest.raises(RuntimeError, match=_kv.DEADLINE_EXCEEDED):
        client.blocking_key_value_get("a", 0)
    assert server.relay_store.key_value_dir_get("ab") == [("ab/4", "w")]
    client.key_value_delete("absent")  # nothing there: nothing to do


def test_wrong_token_or_run_is_refused_and_changes_nothing(server: PeerServer) -> None:
    server.relay_store.key_value_set(KEY, "kept")
    wrong_token = _client(server, token="another-token-value")
    with pytest.raises(PermissionError) as info:
        wrong_token.key_value_set(KEY, "changed", allow_overwrite=True)
    assert "another-token-value" not in str(info.value)
    with pytest.raises(PermissionError):
        wrong_token.blocking_key_value_get(KEY, 0)
    with pytest.raises(PermissionError):
        wrong_token.key_value_delete(KEY)
    wrong_run = _client(server, run_id="run2")
    with pytest.raises(OSError, match="not run 'run2'") as refused:
        wrong_run.key_value_set(KEY, "changed", allow_overwrite=True)
    assert not isinstance(refused.value, RuntimeError)
    with pytest.raises(OSError, match="not run 'run2'"):
        wrong_run.key_value_delete(KEY)
    assert server.relay_store.key_value_dir_get("jaxckpt") == [(KEY, "kept")]


def test_a_closed_server_fails_promptly(tmp_path: Path) -> None:
    srv = PeerServer(tmp_path, run_id=RUN, token=TOKEN)
    srv.start()
    client = _client(srv)
    client.key_value_set(KEY, "v")
    srv.close()
    start = time.monotonic()
    for call in (
        lambda: client.key_value_set(KEY, "w"),
        lambda: client.blocking_key_value_get(KEY, 10_000),
    ):
        with pytest.raises(ConnectionError, match=str(srv.address)):
            call()
    assert time.monotonic() - start < 2.0


def test_closing_ends_a_waiting_get(tmp_path: Path) -> None:
    srv = PeerServer(tmp_path, run_id=RUN, token=TOKEN, io_timeout=30.0)
    srv.start()
    errors: list[BaseException] = []

    def get() -> None:
        try:
            _client(srv).blocking_key_value_get(KEY, 20_000)
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=get)
    reader.start()
    time.sleep(0.3)
    start = time.monotonic()
    srv.close()
    reader.join(5)
    assert not reader.is_alive() and time.monotonic() - start < 3.0
    assert len(errors) == 1 and isinstance(errors[0], OSError), errors


def test_a_request_before_the_runs_token_is_told_waits_for_it(tmp_path: Path) -> None:
    with PeerServer(tmp_path, run_id=RUN, token=None, io_timeout=2.0) as srv:
        setter = threading.Thread(target=lambda: _client(srv).key_value_set(KEY, "early"))
        setter.start()
        time.sleep(0.3)
        assert setter.is_alive() and len(srv.relay_store) == 0
        srv.set_token(TOKEN)
        setter.join(5)
        assert srv.relay_store.blocking_key_value_get(KEY, 0) == "early"


def test_the_service_refuses_bad_keys_and_requests(server: PeerServer) -> None:
    base = f"/relay/{RUN}/"
    too_long = urllib.parse.quote("k" * (RELAY_MAX_KEY_BYTES + 1), safe="")
    for path in (base, base + "a%2F..%2Fb", base + "..", base + too_long):
        status, body = _raw(server, "POST", path, b"v")
        assert status == 400, (path, body)
    assert _raw(server, "GET", base + "k?wait_ms=-1")[0] == 400
    assert _raw(server, "GET", base + "k?wait_ms=x")[0] == 400
    assert _raw(server, "HEAD", base + "k")[0] == 405
    status, body = _raw(server, "GET", base + "k")  # no wait: a timed-out get at once
    assert status == 504 and _kv.DEADLINE_EXCEEDED.encode() in body
    assert _raw(server, "POST", base + "k", b"\xff\xfe")[0] == 400  # not UTF-8
    assert len(server.relay_store) == 0


def test_an_oversized_value_is_refused(server: PeerServer) -> None:
    conn = http.client.HTTPConnection(server.address.host, server.address.port, timeout=TIMEOUT)
    conn.putrequest("POST", f"/relay/{RUN}/{KEY.replace('/', '%2F')}")
    conn.putheader(TOKEN_HEADER, TOKEN)
    conn.putheader("Content-Length", str((64 << 20) + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    with pytest.raises(ValueError, match="over"):
        _client(server).key_value_set(KEY, "x" * ((64 << 20) + 1))
    assert len(server.relay_store) == 0


def test_client_argument_validation(server: PeerServer) -> None:
    for bad in ("", "a/../b", "..", "nul\x00", "k" * (RELAY_MAX_KEY_BYTES + 1)):
        with pytest.raises(ValueError):
            check_relay_key(bad)
        with pytest.raises(ValueError):
            _client(server).key_value_set(bad, "v")
    check_relay_key("a..b/./c")  # opaque: only a '..' component is refused
    with pytest.raises(ValueError):
        _client(server, timeout=0)
    with pytest.raises(ValueError):
        _client(server, token="bad\r\ntoken")
    with pytest.raises(ValueError):
        _client(server, run_id="../x")
    assert TOKEN not in repr(_client(server))
    assert ANSWER_MARGIN_S > 0
