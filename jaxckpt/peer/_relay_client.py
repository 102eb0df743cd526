"""Relay client: a relay group's member reaching its leader's relay store.

A relay group's leader (`jaxckpt.coord._relay`) keeps a `_kv.RelayStore` that
its `PeerServer` serves under ``/relay/`` (see `_wire`). `RelayClient` is that
store as a member sees it: a `_kv.KeyValueClient` over the peer data service,
whose errors are the coordinator's and the store's own (RuntimeErrors whose
text says `ALREADY_EXISTS` or `DEADLINE_EXCEEDED`), so an exchange treats the
coordinator, the leader's store and a member's client alike. Each call opens
one connection through `_client.exchange`.
"""

import json
import math
import time
import urllib.parse
from typing import Final

from jaxckpt.coord import _kv
from jaxckpt.peer import _client, _wire

# A blocking get waits for its answer this much longer than the wait it asks for.
ANSWER_MARGIN_S: Final = 5.0


class RelayClient:
    """The relay store of the peer service at ``address``, as a `_kv.KeyValueClient`.

    Each call is one request on a fresh connection; thread-safe. Its errors:

    * RuntimeError whose text says `_kv.ALREADY_EXISTS` (a set that would
      overwrite) or `_kv.DEADLINE_EXCEEDED` (a get whose key did not come in time),
      as the coordinator's and `_kv.RelayStore`'s;
    * ConnectionError naming the address if the service cannot be reached or drops
      the connection, TimeoutError if it does not answer within the call's bound
      (``timeout``; a blocking get's wait plus `ANSWER_MARGIN_S`);
    * PermissionError if it refuses the token, OSError for any other refusal
      (another run, a malformed request), as the other calls of `_client`;
    * ValueError for a malformed key or value (before any I/O).
    """

    def __init__(
        self, address: _wire.PeerAddress, *, token: str, run_id: str, timeout: float
    ) -> None:
        """Checks the arguments; connects nothing yet.

        Args:
          address: The leader's `PeerServer.address`.
          token: The run's shared secret.
          run_id: The run the leader's service serves.
          timeout: Seconds any one connect, send or receive may block (a blocking
            get's answer: its wait plus `ANSWER_MARGIN_S`).

        Raises:
          ValueError: If an argument is malformed.
        """
        _wire.check_run_id(run_id)
        _wire.check_token(token)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        self._address, self._token, self._run_id = address, token, run_id
        self._timeout = float(timeout)

    @property
    def address(self) -> _wire.PeerAddress:
        """Where the relay store is served."""
        return self._address

    def __repr__(self) -> str:
        return f"RelayClient({self._address}, run={self._run_id!r})"

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        """Sets ``key`` to ``value``; RuntimeError (`ALREADY_EXISTS`) if it is set and
        ``allow_overwrite`` is false."""
        if not isinstance(value, str):
            raise ValueError(f"A relay value must be a str, got {type(value).__name__}.")
        data = value.encode()
        if len(data) > _wire.RELAY_MAX_VALUE_BYTES:
            raise ValueError(
                f"A relay value of {len(data)} bytes (key {key!r}) is over "
                f"{_wire.RELAY_MAX_VALUE_BYTES}."
            )
        query = "?overwrite=1" if allow_overwrite else ""
        status, body = self._call("POST", key, query, "set", send=data)
        self._judge(status, body, "set", key, 409, _kv.ALREADY_EXISTS)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        """The value of ``key``, waiting up to ``timeout_in_ms`` for it to be set;
        RuntimeError (`DEADLINE_EXCEEDED`) if it is not by then.

        The service waits at most its I/O timeout per request: a longer wait is
        asked for again, for what is left of it."""
        deadline = time.monotonic() + max(0, timeout_in_ms) / 1000
        while True:
            wait_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            status, body = self._call(
                "GET",
                key,
                f"?wait_ms={wait_ms}",
                "get",
                answer_timeout=wait_ms / 1000 + ANSWER_MARGIN_S,
            )
            early = status == 504 and wait_ms > 0 and time.monotonic() < deadline
            if early and _kv.DEADLINE_EXCEEDED in _client.refusal_reason(body):
                continue  # The service's own bound came first.
            self._judge(status, body, "get", key, 504, _kv.DEADLINE_EXCEEDED)
            return body.decode()

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        """Every key under ``key/`` with its value, sorted by key."""
        status, body = self._call("GET", key, "?dir=1", "dir_get")
        self._judge(status, body, "dir_get", key)
        return [(str(k), str(v)) for k, v in json.loads(body)["items"]]

    def key_value_delete(self, key: str) -> None:
        """Removes ``key`` and every key under ``key/`` (none there: nothing)."""
        status, body = self._call("DELETE", key, "", "delete")
        self._judge(status, body, "delete", key)

    def _call(
        self,
        method: str,
        key: str,
        query: str,
        what: str,
        *,
        send: bytes | None = None,
        answer_timeout: float | None = None,
    ) -> tuple[int, bytes]:
        _wire.check_relay_key(key)
        url = f"/relay/{urllib.parse.quote(self._run_id)}/{urllib.parse.quote(key, safe='')}{query}"
        return _client.exchange(
            self._address,
            self._token,
            method,
            url,
            self._action(what, key),
            self._timeout,
            send=send,
            answer_timeout=answer_timeout,
        )

    def _action(self, what: str, key: str) -> str:
        return f"relay {what} of key {key!r} of run {self._run_id!r}"

    def _judge(
        self,
        status: int,
        body: bytes,
        what: str,
        key: str,
        store_status: int = 0,
        store_error: str = "",
    ) -> None:
        """Raises the store's RuntimeError for its refusal (``store_status`` whose
        reason says ``store_error``), else as `_client.raise_for_status`."""
        reason = _client.refusal_reason(body)
        if status == store_status and store_error in reason:
            message = f"{reason} (relay store of peer {self._address}, run {self._run_id!r})"
            raise RuntimeError(_client.redact_token(message, self._token))
        _client.raise_for_status(self._address, self._action(what, key), status, body)
