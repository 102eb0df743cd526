"""Peer service server: serves a process's memory tier to other processes over HTTP.

Each process runs one `PeerServer` (a daemon thread in the training process)
that serves ``root/run_id/`` (its memory tier) to peers in the wire format of
`_wire`. Peers read files and byte ranges of slabs with plain HTTP GET (with
``Range``), and push a part (manifest and slab) in one request that the server
verifies and commits atomically. It also serves its process's relay store
(`relay_store`, a `_kv.RelayStore`) under ``/relay/``: when the process leads
a relay group (`jaxckpt.coord._relay`), the group's members reach it there
(`_relay_client.RelayClient`) while the process itself calls it directly.
Each request is answered by a `PeerRequestHandler` on its own thread.
"""

import contextlib
import dataclasses
import functools
import http.server
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

from jaxckpt.coord import _kv, _liveness
from jaxckpt.memory import _fs, _memory_tier
from jaxckpt.peer import _request_handler, _wire

logger = logging.getLogger(__name__)


class PeerHTTPServer(http.server.ThreadingHTTPServer):
    """Threaded HTTP server that tracks its connections so `close` can abort them.

    Each connection is answered by a `PeerRequestHandler` given ``config``.

    Attributes:
      config: The service's run directory, run, token and limits.
    """

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], config: _request_handler.ServiceConfig) -> None:
        """Binds and listens on ``address`` (host, port; port 0 picks a free one)."""
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.config = config
        self._live_lock = threading.Lock()
        self._live: dict[threading.Thread, socket.socket] = {}
        self.handled = 0  # connections served to their end
        super().__init__(
            address, functools.partial(_request_handler.PeerRequestHandler, config=config)
        )

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls getfqdn(), which can block on DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_one,
            args=(request, client_address),
            daemon=True,
            name=f"jaxckpt-peer-{client_address}",
        )
        with self._live_lock:
            self._live[thread] = request
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.pop(threading.current_thread(), None)
                self.handled += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("peer service: request from %s failed", client_address, exc_info=True)

    def abort_requests(self, timeout: float) -> None:
        """Shuts every open connection and joins the handler threads."""
        with self._live_lock:
            live = list(self._live.items())
        for _, sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread, _ in live:
            thread.join(timeout)


class PeerServer:
    """Serves ``root/run_id/`` to the other processes of a run.

    The server binds on construction (so `address` is known at once) and
    serves from a daemon thread after `start`; each connection gets its own
    daemon thread whose socket operations time out after ``io_timeout``.
    Usable as a context manager (start on enter, close on exit).

    Attributes:
      relay_store: The store served under ``/relay/`` (see the module docstring):
        the process calls it directly, the other processes over the service.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        run_id: str,
        token: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_push_bytes: int = 1 << 40,
        io_timeout: float = 60.0,
        reuse_free_slabs: bool = True,
        memory_budget: int | None = None,
    ) -> None:
        """Binds the listening socket.

        Args:
          root: Memory-tier root; the server serves and writes ``root/run_id/``.
          run_id: Identifies the run; requests naming another run are refused.
          token: Shared secret every request must carry; None: told later
            (`set_token`), requests waiting for it meanwhile.
          host: Interface to listen on; a wildcard (``0.0.0.0``, ``::``) is
            advertised under this machine's hostname.
          port: TCP port; 0 picks a free one.
          max_push_bytes: Largest push body accepted; bigger ones get HTTP 413.
          io_timeout: Seconds any one recv/send on a connection may block.
          reuse_free_slabs: Receive a pushed slab into a free slab of the memory
            tier (`MemoryTier.take_free_slab`) when there is one, and give the
            slab of a part a push replaced to them (`MemoryTier.recycle`).
          memory_budget: The memory tier's budget (`TierOptions.memory_budget`),
            which caps the spare slabs it keeps.

        Raises:
          ValueError: If an argument is invalid.
          OSError: If the socket cannot be bound.
        """
        _wire.check_run_id(run_id)
        if token is not None:
            _wire.check_token(token)
        if isinstance(max_push_bytes, bool) or not isinstance(max_push_bytes, int):
            raise ValueError(f"max_push_bytes must be an int, got {max_push_bytes!r}.")
        if max_push_bytes <= 0 or not io_timeout > 0:
            raise ValueError(
                f"max_push_bytes and io_timeout must be positive, got {max_push_bytes!r} "
                f"and {io_timeout!r}."
            )
        run_dir = os.path.realpath(os.path.join(os.fspath(root), run_id))
        os.makedirs(run_dir, exist_ok=True)
        config = _request_handler.ServiceConfig(
            run_dir=run_dir,
            run_id=run_id,
            token=token.encode() if token is not None else b"",
            later_token=_request_handler.LaterToken() if token is None else None,
            max_push_bytes=max_push_bytes,
            io_timeout=io_timeout,
            temp_name=_temp_name,
            relay_store=_kv.RelayStore(),
        )
        if reuse_free_slabs:
            memory = _memory_tier.MemoryTier(os.fspath(root), run_id, memory_budget=memory_budget)
            config = dataclasses.replace(
                config,
                take_free_slab=memory.take_free_slab,
                retire_part=lambda part: memory.dispose(Path(part)),
            )
        self._httpd = PeerHTTPServer((host, port), config)
        self.relay_store = config.relay_store
        advertised = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self._address = _wire.PeerAddress(advertised, self._httpd.server_address[1])
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> _wire.PeerAddress:
        """Where peers reach this server."""
        return self._address

    @property
    def handled(self) -> int:
        """How many connections this server has served to their end (each request's
        cleanup included)."""
        return self._httpd.handled

    def set_token(self, token: str) -> None:
        """Tells a server made without a token the run's (see `__init__`).

        Raises:
          ValueError: if the token is malformed, or the server was made with one.
        """
        _wire.check_token(token)
        later = self._httpd.config.later_token
        if later is None:
            raise ValueError("This peer server was made with its token.")
        later.set(token.encode())

    def start(self) -> None:
        """Starts serving; idempotent.

        First removes temporary entries (`TEMP_PREFIX`) left in the run
        directory by processes of this host that certainly no longer run (judged
        by the pid, process start time, pid namespace and boot recorded in their
        name: a reused pid or a pid of another container is never taken for the
        writer), such as a push cut short by a crash.

        Raises:
          RuntimeError: If the server was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"PeerServer at {self._address} is closed; make a new one.")
            if self._thread is not None:
                return
            _fs.remove_entries(Path(self._httpd.config.run_dir), which=_is_stale_temp)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                daemon=True,
                name=f"jaxckpt-peer-server-{self._address.port}",
            )
            self._thread.start()

    def close(self) -> None:
        """Stops serving, aborts open connections, joins threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._httpd.config.closing.set()  # A relay get waiting ends (`_relay_wait`).
        if thread is not None:
            self._httpd.shutdown()
            thread.join()
        self._httpd.server_close()
        self._httpd.abort_requests(timeout=self._httpd.config.io_timeout)

    def __enter__(self) -> "PeerServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _temp_name(purpose: str) -> str:
    """Returns a fresh temporary entry name that records this process (`_liveness.record`)."""
    return _liveness.owned_name(purpose, _wire.TEMP_PREFIX)


def _is_stale_temp(entry: Path) -> bool:
    """Whether ``entry`` is a `_temp_name` of a process that certainly no longer runs."""
    made_by = _liveness.maker(entry.name, _wire.TEMP_PREFIX)
    return made_by is not None and _liveness.is_gone(made_by)
