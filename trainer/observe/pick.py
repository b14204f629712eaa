"""Which checkpoint a command reads trained weights from (`export`, `sample`, `train.init_from`): a run dir's
newest checkpoint that verifies against its content manifests, or the one `--step` (or a step path) names.

A run that is still training is refused unless the checkpoint is named and sealed: its newest checkpoint may
still be sealing, and retention may delete an older one at any moment. No jax: the choice is made from the
run dir's files (events, heartbeat, manifests) before anything heavy is imported or read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import ConfigError
from trainer.observe import runview
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import manifest, rundir
from trainer.store.event_names import SESSION_STARTS


@dataclass(frozen=True)
class Picked:
    step: int
    dir: Path  # the step directory (RUN/checkpoints/N)
    run_dir: Path | None  # the run it belongs to; None for a step dir outside a run dir
    verified: bool  # False only for a run that saved without manifests (checkpoint.verify: false)
    notes: list[str] = field(default_factory=list)  # newer checkpoints skipped, and why


# A process's share of the verification, gathered into one verdict for all (train.init_from in a group).
Agree = Callable[[Callable[[], manifest.Problem | None]], manifest.Problem | None]


def _alone(check: Callable[[], manifest.Problem | None]) -> manifest.Problem | None:
    return check()


def steps(run_dir: Path) -> list[int]:
    """The run's durable checkpoints (in a bucket: its sealed ones, trainer.store.bucket)."""
    if url := checkpoint_files.durable_url(run_dir):
        from trainer.store import bucket

        return [s for s, ok in bucket.Bucket(url).steps().items() if ok]
    return checkpoint_files.committed_steps(checkpoint_files.durable_dir(run_dir))


def _fetched(run: Path | None, step_dir: Path, share: tuple[int, int] | None) -> manifest.Problem | None:
    """A bucket run's step downloaded into its staging directory (this process's share) before it is
    verified and read; a download that failed is the verdict."""
    url = checkpoint_files.durable_url(run) if run else None
    if url:
        from trainer.store import bucket

        try:
            bucket.Bucket(url).download(int(step_dir.name), step_dir, share or (0, 1))
        except Exception as e:
            return manifest.Problem("", f"could not be downloaded from {url}: {e}"[:300])
    return None


def live_pid(run_dir: Path) -> int | None:
    """The pid of the process training this run dir now (as `status` tells it), or None."""
    try:
        view = runview.load(run_dir)
    except ConfigError:  # no events.jsonl: checkpoints copied here without their run
        return None
    if not runview.run_state(view)[1]:
        return None
    starts = [e for e in view.events if e["event"] in SESSION_STARTS]
    return (starts[-1] if starts else {}).get("pid") or (view.heartbeat.pid if view.heartbeat else None)


def _saved_with_manifests(run_dir: Path | None) -> bool:
    """checkpoint.verify of the run (from its config.yaml); a step dir on its own is judged by its files."""
    try:
        cfg = runview.saved_config(run_dir) or {}
        return bool((cfg.get("checkpoint") or {}).get("verify", True))
    except (ConfigError, TypeError, AttributeError):
        return True


def _where(path: Path, step: int | None) -> tuple[Path | None, int | None]:
    """(run dir, named step) of a run dir or a step dir path."""
    if checkpoint_files.is_step_dir(path):
        if step is not None and step != int(path.name):
            raise ConfigError(f"{path} is the checkpoint of step {path.name}, but --step says {step}")
        run = path.parent.parent if path.parent.name == checkpoint_files.CHECKPOINTS else None
        return run, int(path.name)
    if (path / checkpoint_files.CHECKPOINTS).is_dir() or (
        (path / rundir.CONFIG).is_file()
        and (checkpoint_files.durable_dir(path).is_dir() or checkpoint_files.durable_url(path))
    ):  # a run dir: its checkpoints below it, or where its checkpoint.durable_dir says (a path or a bucket)
        return path, step
    raise ConfigError(
        f"{path} is neither a run dir (with a {checkpoint_files.CHECKPOINTS}/ directory) nor a checkpoint "
        f"(RUN_DIR/{checkpoint_files.CHECKPOINTS}/STEP); pass one of those"
    )


def pick(
    path: str | Path,
    step: int | None = None,
    *,
    agree: Agree = _alone,
    share: tuple[int, int] | None = None,
    name_it: str = "--step",
) -> Picked:
    """The checkpoint to read (ConfigError naming the fix when there is none). `share`/`agree`: processes of a
    group verify a part each and agree on the verdict. `name_it`: how the caller's user names a checkpoint."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass a run dir or RUN_DIR/{checkpoint_files.CHECKPOINTS}/STEP")
    run, named = _where(path, step)
    ckpts = checkpoint_files.durable_dir(run) if run else path.parent
    have = steps(run) if run else [named]
    if named is not None and named not in have:
        raise ConfigError(f"{run} has no checkpoint of step {named}; it has: {_listing(have)}")
    pid = live_pid(run) if run else None
    if pid and named is None:
        sealed = have if checkpoint_files.durable_url(run) else [s for s in have if manifest.sealed(ckpts / str(s))]
        raise ConfigError(
            f"{run} is still training (pid {pid}): its newest checkpoint may still be written; "
            f"name a sealed one ({name_it}): {_listing(sealed)}"
        )
    with_manifests = _saved_with_manifests(run) if run else (path / manifest.DIR).is_dir()
    notes: list[str] = []
    for s in [named] if named is not None else sorted(have, reverse=True):
        step_dir = ckpts / str(s)
        if not with_manifests:  # nothing to check against: committed (renamed into place) is all we can know
            return Picked(s, step_dir, run, False, notes)
        problem = agree(lambda d=step_dir: _fetched(run, d, share) or manifest.verify(d, share=share))
        if problem is None:
            return Picked(s, step_dir, run, True, notes)
        why = problem.reason + (f" ({problem.file})" if problem.file else "")
        if named is not None:
            other = f"name another ({name_it}): {_listing(have)}" if run else "use another one"
            raise ConfigError(f"checkpoint {step_dir} does not verify: {why}; {other}")
        notes.append(f"step {s} skipped: {why}")
    raise ConfigError(
        f"no checkpoint of {run} verifies ({'; '.join(notes) or 'it has none'}); "
        f"`python -m trainer checkpoints {run} --verify` lists them"
    )


def _listing(have: list[int]) -> str:
    return ", ".join(map(str, have)) if have else "none"
