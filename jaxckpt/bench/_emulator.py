"""A local object-store emulator for the benchmark's object-store phase (`--store-emulator`).

Starts gcp-storage-emulator (GCS, in memory) or `moto_server` (S3), both in the `dev`
extra, on a free loopback port, waits for it (bounded), creates one bucket, and hands
back the bucket URL and the environment every client needs to reach it: tensorstore
(the persister and the baseline), gcsfs/s3fs (Orbax's manager, through etils). Stopped
by its process group id, bounded, at the end.

The GCS emulator is run with fixes (`_GCS_SERVER`) without which it measures two
1-second timers and its own bookkeeping instead of the writes:

- its single-threaded `HTTPServer` listens with a backlog of 5: with more connections
  at once than that, the kernel drops SYNs and the client resends them after 1 s;
- it speaks HTTP/1.0, so it never answers `Expect: 100-continue`, and curl (in
  tensorstore) waits 1 s before sending the body of every object over 1 MiB;
- it serializes the metadata of every object it holds (soft-deleted ones included,
  kept for 7 days) into a JSON file on every write and delete: each request costs
  O(objects stored), and a run slows down as the bucket fills (2-4x over 4 repeats);
- it sends no object generation with a download (`x-goog-generation`, which real GCS
  always sends): tensorstore's read of a tile of a zarr3 shard (the shard's index, then
  the tile at the index's generation) fails without it.

Here the backlog is 1024; the handler speaks HTTP/1.1 (answering 100-continue) with one
request per connection (the server is single-threaded: a kept-alive connection would
hold off every other one); the in-memory store writes no metadata file (nothing would
read it back) and deletes at once. Measured here with tensorstore, 32 objects of 4 MiB:
0.5 s instead of 11 s with 64 requests in flight, and instead of 32 s one at a time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

KINDS: Final = ("gcs", "s3")
BUCKET: Final = "jaxckpt-bench"
_START_TIMEOUT_S: Final = 30.0

# gcp-storage-emulator's downloads given the object's generation (`x-goog-generation`),
# as real GCS sends it (tensorstore reads a tile of a zarr3 shard at its index's
# generation). Python run inside the emulator's process; tests/support runs it too.
GCS_GENERATIONS: Final = """
import gcp_storage_emulator.server as _gcs_server
from gcp_storage_emulator.handlers import objects

original = objects.download

def download(request, response, storage, *args, **kwargs):
    original(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:
        return
    response["x-goog-generation"] = str(obj["generation"])

objects.download = download
for _, methods in _gcs_server.HANDLERS:
    for method, handler in list(methods.items()):
        if handler is original:
            methods[method] = download

"""

# Runs gcp-storage-emulator's server with the fixes of the module docstring (argv: host,
# port). A script, not a module of this package: the emulator need not import jax.
_GCS_SERVER: Final = (
    """
import http.server, sys
from gcp_storage_emulator import server as gcs, storage

# In memory, nothing reads the metadata file back; deletes free the objects' memory.
storage.Storage._write_config_to_file = lambda self: None
storage.Storage._bucket_soft_delete_retention_seconds = lambda self, bucket: 0

class Handler(gcs.RequestHandler):
    protocol_version = "HTTP/1.1"  # answers Expect: 100-continue

    def end_headers(self):
        self.send_header("Connection", "close")  # one request per connection
        super().end_headers()
"""
    + GCS_GENERATIONS
    + """
http.server.HTTPServer.request_queue_size = 1024
gcs.RequestHandler = Handler
gcs.create_server(sys.argv[1], int(sys.argv[2]), in_memory=True).run()
"""
)


def available(kind: str) -> bool:
    """Whether the emulator of `kind` is installed (the dev extra)."""
    if kind == "gcs":
        return importlib.util.find_spec("gcp_storage_emulator") is not None
    return _moto_server() is not None


def _moto_server() -> str | None:
    """moto's executable (next to this Python's first)."""
    name = "moto_server"
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


class Emulator:
    """One emulator process, started by `start` and stopped by `stop`."""

    def __init__(self, kind: str, log_path: Path):
        # Imported here: `jaxckpt bench --gpu` runs without the launcher's dependencies.
        from jaxckpt.launch._supervise import free_port

        self.kind = kind
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.url = f"{'gs' if kind == 'gcs' else 's3'}://{BUCKET}"
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What the clients read to reach this emulator (and not a real store)."""
        if self.kind == "gcs":
            return {
                "STORAGE_EMULATOR_HOST": self.endpoint,  # gcsfs (Orbax's manager via etils)
                "TENSORSTORE_GCS_HTTP_URL": self.endpoint,  # tensorstore's gcs kvstore
                "GOOGLE_CLOUD_PROJECT": "bench",
                "NO_GCE_CHECK": "True",  # google-auth: no metadata server to wait for
            }
        return {
            "AWS_ENDPOINT_URL": self.endpoint,  # s3fs/boto; jaxckpt puts it in tensorstore's spec
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> None:
        """Starts the emulator and creates the bucket; stops it again if that fails.

        Raises:
          RuntimeError: if the emulator is not installed, exits at start, or refuses
            the bucket (with the end of its log).
          TimeoutError: if it does not answer within 30 s.
        """
        moto = _moto_server()
        if not available(self.kind):
            raise RuntimeError(
                f"--store-emulator {self.kind} needs the dev extra: pip install 'jaxckpt[dev]'"
            )
        if self.kind == "gcs":
            cmd = [sys.executable, "-c", _GCS_SERVER, "127.0.0.1", str(self.port)]
        else:
            assert moto is not None
            cmd = [moto, "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_and_make_bucket()
        except BaseException:
            self.stop()
            raise

    def _wait_and_make_bucket(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None:
                raise RuntimeError(f"The {self.kind} emulator exited at start:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The {self.kind} emulator did not answer at {self.endpoint} within "
                    f"{_START_TIMEOUT_S:.0f} s:\n{self._log_tail()}"
                )
            time.sleep(0.1)
        try:
            self._make_bucket()
        except OSError as e:
            raise RuntimeError(
                f"The {self.kind} emulator did not create the bucket: {e}\n{self._log_tail()}"
            ) from e

    def _log_tail(self) -> str:
        """The end of the emulator's output (its log is removed with the run's logs)."""
        try:
            return self._log_path.read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # an error status is an answer
        except OSError:
            return False
        return True

    def _make_bucket(self) -> None:
        if self.kind == "gcs":
            request = urllib.request.Request(
                f"{self.endpoint}/storage/v1/b?project=bench",
                data=f'{{"name": "{BUCKET}"}}'.encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
        else:
            request = urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        """Stops the emulator's process group: SIGTERM, then SIGKILL after 5 s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
