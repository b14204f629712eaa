"""The durable tier in a bucket: `checkpoint.durable_dir` = s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, through
TensorStore's own kvstore drivers (`s3`, `gcs`). No jax.

Orbax cannot write s3:// (its spec builder takes every path that is not gs:// for a local file) and commits a
step by renaming its directory, which a bucket does not have. So Orbax writes each step into a staging
directory (RUN_DIR/checkpoints: the run dir is on a file system all processes see, as Orbax's multi-process
commit needs), and once this process's manifest is written (trainer.ckpt.manifest), its sealing thread
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

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.ckpt import manifest
from trainer.observe.rundir import atomic_write

SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> TensorStore kvstore driver
_MANIFESTS = manifest.DIR + "/"


def is_url(location: str | None) -> bool:
    return bool(location) and str(location).split("://", 1)[0] in SCHEMES and "://" in str(location)


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


def spec(loc: Location) -> dict:
    """The TensorStore kvstore spec, with region and credentials set from the environment (S3: a missing
    region would make TensorStore ask the bucket, credentials left to "default" would probe EC2's metadata)."""
    if loc.scheme == "gs":
        return {"driver": "gcs", "bucket": loc.bucket, "path": loc.prefix}
    out = {
        "driver": "s3",
        "bucket": loc.bucket,
        "path": loc.prefix,
        "aws_region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "aws_credentials": {"type": "environment"},
    }
    if os.environ.get("AWS_ENDPOINT_URL"):
        out["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    return out


def _range(prefix: str):
    import tensorstore as ts

    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


class Bucket:
    """One run's durable prefix. Keys mirror the staging directory: STEP/REL for each file of a step."""

    def __init__(self, url: str):
        self.loc = parse(url)
        self._kv = None

    @property
    def kv(self):
        if self._kv is None:
            import tensorstore as ts

            self._kv = ts.KvStore.open(spec(self.loc)).result()
        return self._kv

    def check(self) -> str | None:
        """Whether the bucket answers (exists, credentials accepted): None, or one line saying what to fix.
        A list, not a read: a read of a missing bucket's key answers "missing" like a missing key."""
        if self.loc.scheme == "s3" and not os.environ.get("AWS_ACCESS_KEY_ID"):
            return (
                f"checkpoint.durable_dir {self.loc}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_ENDPOINT_URL for a store other than AWS)"
            )
        try:
            manifest.retrying(lambda: self.kv.list(_range(_MANIFESTS)).result())
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
        for key in manifest.retrying(lambda: self.kv.list().result()):
            name = key.decode()
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

    def read(self, key: str) -> bytes:
        r = manifest.retrying(lambda: self.kv.read(key).result())
        if r.state != "value":
            raise FileNotFoundError(f"{self.loc}{key}: no such object")
        return r.value

    def upload(self, step_dir: Path, process: int) -> int:
        """This process's files of a sealed staging step (those its manifest lists), then its manifest: the
        step's commit marker in the bucket. Returns the bytes sent."""
        step_dir = Path(step_dir)
        step = step_dir.name
        rec = json.loads(manifest.manifest_path(step_dir, process).read_text())
        futures = [(rel, self.kv.write(f"{step}/{rel}", (step_dir / rel).read_bytes())) for rel in rec["files"]]
        for _, f in futures:
            manifest.retrying(f.result)
        mine = manifest.manifest_path(step_dir, process).relative_to(step_dir).as_posix()
        manifest.retrying(lambda: self.kv.write(f"{step}/{mine}", (step_dir / mine).read_bytes()).result())
        return sum(int(f["bytes"]) for f in rec["files"].values())

    def download(self, step: int, step_dir: Path, share: tuple[int, int]) -> int:
        """Into the staging directory: the manifests m with m % n == i (share = (i, n)) and the files they list
        (the other processes download theirs). Files are written atomically: a process never reads a half
        file another is writing. Returns the bytes received."""
        step_dir, got = Path(step_dir), 0
        names = sorted(
            k.decode()[len(f"{step}/") :]
            for k in manifest.retrying(lambda: self.kv.list(_range(f"{step}/{_MANIFESTS}")).result())
        )
        mine = [n for n in names if int(n.rsplit("_", 1)[1].split(".")[0]) % share[1] == share[0]]
        for name in mine:
            raw = self.read(f"{step}/{name}")
            rels = list(json.loads(raw)["files"])
            futures = [(rel, self.kv.read(f"{step}/{rel}")) for rel in rels]
            for rel, f in futures:
                r = manifest.retrying(f.result)
                if r.state != "value":
                    continue  # missing: verification names it
                (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                atomic_write(step_dir / rel, r.value, durable=False)
                got += len(r.value)
            (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(step_dir / name, raw, durable=False)
        return got

    def delete(self, step: int) -> None:
        """A step's objects, its manifests first: a deletion cut short leaves an unsealed step, never a
        sealed one with files missing."""
        manifest.retrying(lambda: self.kv.delete_range(_range(f"{step}/{_MANIFESTS}")).result())
        manifest.retrying(lambda: self.kv.delete_range(_range(f"{step}/")).result())
