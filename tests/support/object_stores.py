"""Local object-store emulators for tests: GCS (gcp-storage-emulator) and S3 (moto_server).

Each `Emulator` runs in its own process on a free loopback port, is waited for
(bounded), sets the environment its clients read (gcsfs/etils, s3fs/boto,
tensorstore), creates one bucket, and is stopped by its pid (bounded) at the
end. The emulators are in the `dev` extra of pyproject.toml.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import portpicker
import psutil

from jaxckpt.bench._emulator import GCS_GENERATIONS

# Each emulator gets a bucket of its own name: tensorstore keeps open kvstore drivers
# by spec, and a GCS spec names no endpoint (TENSORSTORE_GCS_HTTP_URL is read when the
# driver opens), so an earlier emulator's driver for the same bucket could be reused.
BUCKET_PREFIX = "jaxckpt-test"
START_TIMEOUT_S = 30.0
PORT_TRIES = 3  # first starts, each on a fresh port
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+"')

# gcp-storage-emulator, with the one thing of real GCS it lacks that tensorstore needs:
# an object's generation on every download (`x-goog-generation`; see GCS_GENERATIONS).
_GCS_WITH_GENERATIONS = (
    GCS_GENERATIONS
    + """
import sys
from gcp_storage_emulator import __main__ as cli
sys.exit(cli.main(sys.argv[1:]))
"""
)


class Emulator:
    """One running emulator; `url(path)` names a location in its bucket."""

    def __init__(self, kind: str, log_dir: Path, data_dir: Path | None = None):
        self.kind = kind
        self.data_dir = data_dir  # GCS only: keep objects on disk there (they survive a kill)
        self._pick_port()
        self._started = False
        self.scheme = {"gcs": "gs", "s3": "s3"}[kind]
        self._log = open(log_dir / f"{kind}-emulator.log", "ab")  # noqa: SIM115 -- closed in stop()
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick_port(self) -> None:
        self.port = portpicker.pick_unused_port()
        self.bucket = f"{BUCKET_PREFIX}-{self.port}"
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.bucket}/{path}"

    def env(self) -> dict[str, str]:
        """What clients read to reach this emulator (and nothing else)."""
        if self.kind == "gcs":
            return {
                "STORAGE_EMULATOR_HOST": self.endpoint,  # gcsfs (etils epath)
                "TENSORSTORE_GCS_HTTP_URL": self.endpoint,  # tensorstore's gcs kvstore
                "GOOGLE_CLOUD_PROJECT": "test",
                "NO_GCE_CHECK": "True",  # google-auth: no metadata server here, don't wait for one
            }
        return {
            "AWS_ENDPOINT_URL": self.endpoint,  # s3fs/boto; jaxckpt passes it to tensorstore
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> None:
        """Starts the emulator and waits (bounded) until it listens on its port.

        The port was only free a moment ago: where another process (another test
        worker's server) took it meanwhile, a first start moves to a fresh port. Ready
        means this emulator's own process listens, never just that the port answers.
        """
        for tries_left in reversed(range(PORT_TRIES)):
            self._launch()
            if self._wait_listening():
                break
            if self._started or tries_left == 0:  # a restart keeps its port (and bucket)
                raise RuntimeError(
                    f"The {self.kind} emulator could not listen on port {self.port} (it"
                    f" exited, or another process holds the port); see {self._log.name}."
                )
            self._pick_port()
        self._started = True
        self.make_bucket()

    def _launch(self) -> None:
        bin_dir = Path(sys.executable).parent
        env = dict(os.environ)
        if self.kind == "gcs":
            cmd = [sys.executable, "-c", _GCS_WITH_GENERATIONS, "start", "--host=127.0.0.1"]
            cmd.append(f"--port={self.port}")
            if self.data_dir is None:
                cmd.append("--in-memory")
            else:
                env["STORAGE_BASE"] = str(self.data_dir)
        else:
            exe = shutil.which("moto_server", path=str(bin_dir)) or "moto_server"
            cmd = [exe, "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def _wait_listening(self) -> bool:
        """Whether the emulator's process came to listen on its port. False where it
        exited, or where another process listens there (this one is then stopped: the GCS
        emulator lives on after its server thread failed to bind)."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.proc.poll() is None:
            listeners = {
                c.pid
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
            }
            if self.proc.pid in listeners:
                return True
            if listeners:
                self.kill()
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"The {self.kind} emulator did not listen on {self.endpoint} within "
                    f"{START_TIMEOUT_S:.0f} s; see {self._log.name}."
                )
            time.sleep(0.1)
        return False

    def make_bucket(self) -> None:
        """Creates the bucket (a restarted emulator that kept it on disk has it already)."""
        try:
            self._make_bucket()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def _make_bucket(self) -> None:
        if self.kind == "gcs":
            body = f'{{"name": "{self.bucket}"}}'.encode()
            request = urllib.request.Request(
                f"{self.endpoint}/storage/v1/b?project=test",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
        else:
            request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()

    def requests(self) -> list[tuple[str, str]]:
        """(method, decoded target) of every request the emulator logged so far."""
        self._log.flush()
        out = []
        for line in Path(self._log.name).read_text(errors="replace").splitlines():
            found = _REQUEST.search(line)
            if found:
                out.append((found.group(1), urllib.parse.unquote(found.group(2))))
        return out

    def object_writes(self) -> list[str]:
        """The name of every object written so far, once per write (a simple upload, a
        multipart upload's completion, a resumable upload's start; never a bucket's
        creation). On GCS, an upload that names its object only in its body shows "?"."""
        names = []
        for method, target in self.requests():
            path, _, query = target.partition("?")
            params = urllib.parse.parse_qs(query)
            if self.kind == "s3":
                prefix = f"/{self.bucket}/"
                if not path.startswith(prefix) or path == prefix:
                    continue
                if (method == "PUT" and "partNumber" not in params) or (
                    method == "POST" and "uploadId" in params
                ):
                    names.append(path[len(prefix) :])
            elif (
                method == "POST"
                and path == f"/upload/storage/v1/b/{self.bucket}/o"
                and "upload_id" not in params  # a resumable upload's data, not another object
            ):
                names.append(params.get("name", ["?"])[0])
        return names

    def kill(self) -> None:
        """Kills the emulator at once (a store that vanishes mid-upload)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Starts a killed emulator again on the same port (and data directory)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        if not self._log.closed:
            self._log.close()


@contextlib.contextmanager
def running(kind: str, log_dir: Path, data_dir: Path | None = None) -> Iterator[Emulator]:
    """An emulator started for the block and stopped after it."""
    emulator = Emulator(kind, log_dir, data_dir)
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def reset_clients() -> None:
    """Drops cached filesystems (fsspec's and etils epath's), so that the next ones read
    the new environment (another emulator's endpoint)."""
    import fsspec
    from etils.epath import backend

    for name in ("gcs", "gs", "s3"):
        with contextlib.suppress(Exception):
            fsspec.get_filesystem_class(name).clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()
