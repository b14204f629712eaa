"""The durable tier in a bucket: `checkpoint.durable_dir` = s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, through
TensorStore's own kvstore drivers (`s3`, `gcs`). No jax.

Orbax cannot write s3:// (its spec builder takes every path that is not gs:// for a local file) and commits a
step by renaming its directory, which a bucket does not have. So Orbax writes each step into a staging
directory (RUN_DIR/checkpoints: the run dir is on a file system all processes see, as Orbax's multi-process
commit needs), and once this process's manifest is written (trainer.store.manifest), its sealing thread
uploads the files that manifest lists, then the manifest itself. A step is whole in the bucket when every
process's manifest is there (the same test as on disk), so a save torn anywhere (a process killed, the
endpoint gone) leaves a step without all its manifests, which nothing restores; deletion removes the
manifests first for the same reason. A restore downloads the step into the staging directory, each process
its share of the manifests, and verifies it there before Orbax reads it.

Credentials and endpoint come from the standard environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_DEFAULT_REGION or AWS_REGION, AWS_ENDPOINT_URL for S3; Google's application default
credentials for GCS, TENSORSTORE_GCS_HTTP_URL for an emulator): set explicitly in the spec, so nothing
probes a cloud metadata server, and never written to a log or an event.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.store import manifest
from trainer.store.rundir import atomic_write

SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> TensorStore kvstore driver
_MANIFESTS = manifest.DIR + "/"


@dataclass(frozen=True)
class Location:
    scheme: str
    bucket: str
    prefix: str  # "" or ending in "/"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse(url: str) -> Location:
    """s3://BUCKET/PREFIX or gs://BUCKET/PREFIX; raises ValueError saying what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        raise ValueError(f"{url!r}: only s3:// and gs:// buckets are supported")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: write {scheme}://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    return Location(scheme, bucket, prefix + "/" if prefix else "")


PATIENCE_S = 120.0  # checkpoint.bucket_patience_s's default


def retries(patience_s: float) -> dict:
    """TensorStore's request retries (its s3/gcs drivers retry failed requests, HTTP 503 SlowDown included,
    with exponential backoff) for an outage of about `patience_s`: waits of 1, 2, 4, 8, then 16 s; 0: one try."""
    waits, n = 0.0, 0
    while waits < patience_s:
        waits, n = waits + min(2.0**n, 16.0), n + 1
    return {"max_retries": max(n, 1), "initial_delay": "1s", "max_delay": "16s"}


def spec(loc: Location, patience_s: float = PATIENCE_S) -> dict:
    """The TensorStore kvstore spec, with region and credentials set from the environment (S3: a missing
    region would make TensorStore ask the bucket, credentials left to "default" would probe EC2's metadata),
    and retries for an outage of `patience_s` (TensorStore's default is 32 retries: ~15 minutes)."""
    if loc.scheme == "gs":
        context = {"gcs_request_retries": retries(patience_s)}
        return {"driver": "gcs", "bucket": loc.bucket, "path": loc.prefix, "context": context}
    out = {
        "driver": "s3",
        "bucket": loc.bucket,
        "path": loc.prefix,
        "aws_region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "aws_credentials": {"type": "environment"},
        "context": {"s3_request_retries": retries(patience_s)},
    }
    if os.environ.get("AWS_ENDPOINT_URL"):
        out["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    return out


def _range(prefix: str):
    import tensorstore as ts

    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


class Bucket:
    """One run's durable prefix. Keys mirror the staging directory: STEP/REL for each file of a step."""

    def __init__(self, url: str, patience_s: float = PATIENCE_S):
        self.loc, self.patience_s = parse(url), patience_s
        self._kv, self._probe = None, None

    @property
    def kv(self):
        if self._kv is None:
            import tensorstore as ts

            self._kv = ts.KvStore.open(spec(self.loc, self.patience_s)).result()
        return self._kv

    def check(self) -> str | None:
        """Whether the bucket answers (exists, credentials accepted): None, or one line saying what to fix.
        A list, not a read: a read of a missing bucket's key answers "missing" like a missing key."""
        if self.loc.scheme == "s3" and not os.environ.get("AWS_ACCESS_KEY_ID"):
            return (
                f"checkpoint.durable_dir {self.loc}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_ENDPOINT_URL for a store other than AWS)"
            )
        import tensorstore as ts

        if self._probe is None:  # a quick answer: the caller polls
            self._probe = ts.KvStore.open(spec(self.loc, 2.0)).result()
        try:
            self._probe.list(_range(_MANIFESTS)).result()
        except Exception as e:
            first = (str(e).split("[http_response_body", 1)[0].strip().splitlines() or [type(e).__name__])[0]
            return (
                f"checkpoint.durable_dir {self.loc}: the bucket cannot be listed ({first[:200]}); create it or "
                "fix the credentials"
            )
        return None

    def steps(self) -> dict[int, bool]:
        """Every step with objects under the prefix: whether it is sealed (all its manifests there)."""
        found: dict[int, set[str]] = {}
        for name in self._list(""):
            step, _, rel = name.partition("/")
            if step.isdigit():
                found.setdefault(int(step), set()).add(rel)
        return {s: self._sealed(s, rels) for s, rels in sorted(found.items())}

    def _sealed(self, step: int, rels: set[str]) -> bool:
        names = {r for r in rels if r.startswith(_MANIFESTS)}
        if not names:
            return False
        try:
            any_one = json.loads(self.read(f"{step}/{sorted(names)[0]}"))
            processes = int(any_one["processes"])
        except (ValueError, KeyError, TypeError):
            return False
        return all(f"{_MANIFESTS}process_{i}.json" in names for i in range(processes))

    def manifests(self, step: int) -> tuple[dict[int, dict], list[manifest.Problem]]:
        """A step's manifests in the bucket, and what is wrong with the set (trainer.store.manifest's rules)."""
        keys = self._list(f"{step}/{_MANIFESTS}")
        return manifest.judge({k.rsplit("/", 1)[1]: lambda k=k: self.read(k) for k in keys}, unfinished="uploading")

    def verify(self, step: int) -> manifest.Problem | None:
        """Every object of a step against its manifest (size and sha256), read from the bucket: the first
        problem, or None."""
        found, problems = self.manifests(step)
        if problems:
            return problems[0]
        for rec in found.values():
            for rel, want in rec["files"].items():
                r = self.kv.read(f"{step}/{rel}").result()
                if r.state != "value":
                    return manifest.Problem(rel, "object missing")
                if len(r.value) != want["bytes"]:
                    return manifest.Problem(rel, f"size {len(r.value)} bytes, {want['bytes']} when saved (truncated)")
                if hashlib.sha256(r.value).hexdigest() != want["sha256"]:
                    return manifest.Problem(rel, "content checksum mismatch (bytes changed since the save)")
        return None

    def read(self, key: str) -> bytes:
        r = self.kv.read(key).result()
        if r.state != "value":
            raise FileNotFoundError(f"{self.loc}{key}: no such object")
        return r.value

    def upload(self, step_dir: Path, process: int) -> int:
        """This process's files of a sealed staging step (those its manifest lists), then its manifest: the
        step's commit marker in the bucket. Returns the bytes sent."""
        step_dir = Path(step_dir)
        rec = json.loads(manifest.manifest_path(step_dir, process).read_text())
        sizes = {rel: int(f["bytes"]) for rel, f in rec["files"].items()}
        _windowed(sizes, lambda rel: self.kv.write(f"{step_dir.name}/{rel}", (step_dir / rel).read_bytes()), None)
        mine = manifest.manifest_path(step_dir, process).relative_to(step_dir).as_posix()
        self.kv.write(f"{step_dir.name}/{mine}", (step_dir / mine).read_bytes()).result()
        return sum(sizes.values())

    def download(self, step: int, step_dir: Path, share: tuple[int, int]) -> int:
        """Into the staging directory: the manifests m with m % n == i (share = (i, n)) and the files they list
        (the other processes download theirs). Files are written atomically: a process never reads a half
        file another is writing. Returns the bytes received."""
        step_dir = Path(step_dir)
        names = [k.split("/", 1)[1] for k in self._list(f"{step}/{_MANIFESTS}")]
        got = 0
        for name in [n for n in names if int(n.rsplit("_", 1)[1].split(".")[0]) % share[1] == share[0]]:
            raw = self.read(f"{step}/{name}")
            sizes = {rel: int(f["bytes"]) for rel, f in json.loads(raw)["files"].items()}

            def land(rel: str, r) -> None:
                if r.state == "value":  # a missing object is left missing: verification names it
                    (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(step_dir / rel, r.value, durable=False)

            _windowed(sizes, lambda rel: self.kv.read(f"{step}/{rel}"), land)
            (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(step_dir / name, raw, durable=False)
            got += sum(sizes.values())
        return got

    def delete(self, step: int) -> None:
        """A step's objects, its manifests first: a deletion cut short leaves an unsealed step, never a
        sealed one with files missing. Key by key (a write of None), not TensorStore's delete_range: that
        trusts the server to honour the range, and a server that ignores it loses every step at once."""
        for prefix in (f"{step}/{_MANIFESTS}", f"{step}/"):
            for f in [self.kv.write(k, None) for k in self._list(prefix)]:
                f.result()

    def _list(self, prefix: str) -> list[str]:
        """The keys under `prefix`, sorted; filtered here too, whatever the server made of the range."""
        keys = self.kv.list(_range(prefix)).result() if prefix else self.kv.list().result()
        return sorted(k for k in (b.decode() for b in keys) if k.startswith(prefix))


IN_FLIGHT = 1 << 30  # bytes of transfers started and not finished: parallel requests, bounded host memory


def _windowed(sizes: dict[str, int], start, done) -> None:
    """start(rel) for every file (a TensorStore future), many at once but at most IN_FLIGHT bytes of them;
    done(rel, result) as each finishes in order (None: nothing to do). Raises the first failure."""
    pending: list[tuple[str, object, int]] = []
    flying = 0
    for rel, size in sizes.items():
        while pending and flying + size > IN_FLIGHT:
            r, f, n = pending.pop(0)
            out, flying = f.result(), flying - n
            if done:
                done(r, out)
        pending.append((rel, start(rel), size))
        flying += size
    for r, f, _ in pending:
        out = f.result()
        if done:
            done(r, out)
