"""A real S3 endpoint on loopback for the bucket tests: moto's server mode (`python -m moto.server`, from PyPI:
the test extras install it), and a relay in front of it that a test can cut. The `s3` fixture (conftest)
starts one per module."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BUCKET = "ckpt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A storage server in a child process on a free loopback port; `scheme`: the URL scheme it serves."""

    scheme = ""

    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return
            except urllib.error.HTTPError:  # it answers (an error page for "/")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.command()[:3]} did not answer on {self.url}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def kv(self, prefix: str):
        """A TensorStore client of the bucket (the test's own, to look at and damage objects; the server's
        variables must be in this process's environment: the fixtures put them there)."""
        import tensorstore as ts

        from trainer.store import bucket

        return ts.KvStore.open(bucket.spec(bucket.parse(f"{self.scheme}://{BUCKET}/{prefix}"))).result()


class S3Server(_Server):
    """`python -m moto.server`: a real HTTP S3 endpoint (not a mock of any client), objects in memory."""

    scheme = "s3"

    def __init__(self):
        super().__init__()
        self.env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
        }

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def make_bucket(self, name: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT")).read()


class GCSServer(_Server):
    """`gcp-storage-emulator` (PyPI): GCS's JSON API in memory, with the bucket BUCKET. It ignores a list's
    startOffset/endOffset, which TensorStore's gcs driver sends for every ranged list: trainer.store.bucket
    filters keys itself and deletes key by key."""

    scheme = "gs"

    def __init__(self):
        super().__init__()
        self.env = {"TENSORSTORE_GCS_HTTP_URL": self.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token"}

    def command(self) -> list[str]:
        exe = str(Path(sys.executable).with_name("gcp-storage-emulator"))
        return [exe, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"]

    def make_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.url}/storage/v1/b", data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        urllib.request.urlopen(req).read()


_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n"
SLOW_DOWN = b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n" + (
    b"Content-Length: %d\r\n\r\n" % len(_BODY) + _BODY
)


class Relay:
    """A TCP relay in front of the S3 server that the test cuts (listener and every connection closed: new
    ones refused) and restores: the endpoint gone for a while, the server's objects kept (moto keeps them in
    memory: stopping it would lose them). `throttle = N`: the next N connections get S3's HTTP 503 SlowDown
    to their first request, as a throttled bucket answers, and are closed."""

    def __init__(self, target: int):
        self.target = target
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.throttle = 0
        self.throttled = 0  # SlowDown answers given

    def up(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def down(self) -> None:
        self._listener.close()
        self.drop_connections()

    def drop_connections(self) -> None:
        """Close the relayed connections (the listener stays): the client's next request opens a new one."""
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._socks = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.throttle > 0:
                self.throttle, self.throttled = self.throttle - 1, self.throttled + 1
                threading.Thread(target=self._slow_down, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _slow_down(client: socket.socket) -> None:
        head = b""
        try:
            while b"\r\n\r\n" not in head and (data := client.recv(1 << 16)):
                head += data
            client.sendall(SLOW_DOWN)
        except OSError:
            pass
        client.close()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def until(done, timeout: float = 120.0) -> None:
    """Wait until done() (a look at a run dir being written: a missing file is not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if done():
                return
        except FileNotFoundError:  # no events.jsonl yet
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
