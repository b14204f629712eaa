"""Loss-spike runbook, end to end: a corpus with a region of random bytes, trained in sequential order so
the region arrives as a run of batches, against the same corpus without it. Prints the detection, the
rewind, the skipped batches and both final losses side by side.

    python -m benchmarks.runbook_spike [--config configs/tiny.yaml] [--set key=value ...]  (~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_corpora(
    root: Path, *, batch_tokens: int, text_bytes: int, garbage_at: int, garbage_batches: int, seed: int = 0
) -> tuple[Path, Path, list[int]]:
    """root/clean and root/spiked hold the same Python-stdlib text; spiked has `garbage_batches` batches of
    random bytes inserted at data batch `garbage_at`, aligned to batch boundaries (byte tokenizer,
    sequential order: batch b reads tokens [b * batch_tokens, (b + 1) * batch_tokens]). Returns the clean
    dir, the spiked dir and the data batch indices that read garbage."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for p in sorted(stdlib.glob("*.py")):
        parts.append(p.read_bytes())
        size += len(parts[-1])
        if size >= text_bytes:
            break
    text = b"".join(parts)[:text_bytes]
    cut = garbage_at * batch_tokens
    assert cut < len(text), f"the text ({len(text)} bytes) ends before batch {garbage_at}"
    garbage = np.random.default_rng(seed).integers(0, 256, garbage_batches * batch_tokens, dtype=np.uint8)
    dirs = []
    for name, body in (("clean", text), ("spiked", text[:cut] + garbage.tobytes() + text[cut:])):
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "corpus.txt").write_bytes(body)
        dirs.append(d)
    return dirs[0], dirs[1], list(range(garbage_at, garbage_at + garbage_batches))


def _events(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _train(config: str, run_dir: Path, overrides: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        config,
        "--set",
        f"run.dir={run_dir}",
        *[a for o in overrides for a in ("--set", o)],
    ]
    return subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/runbook_spike")
    ap.add_argument(
        "--garbage-at",
        type=int,
        default=149,
        help="first data batch of the garbage region (149: step 150 reads it, and the checkpoint of "
        "step 150 already holds its update, so the rewind has to move it aside)",
    )
    ap.add_argument("--garbage-batches", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from trainer.config import load_config

    cfg = load_config(args.config, args.set)
    out = Path(args.out).absolute()
    batch_tokens = cfg.data.batch_size * cfg.model.seq_len
    clean, spiked, bad = write_corpora(
        out / "data",
        batch_tokens=batch_tokens,
        text_bytes=(cfg.train.steps + 10) * batch_tokens,
        garbage_at=args.garbage_at,
        garbage_batches=args.garbage_batches,
    )
    print(f"garbage region: data batches {bad[0]}-{bad[-1]} (steps {bad[0] + 1}-{bad[-1] + 1} in sequential order)")
    rows = {}
    for name, data in (("clean", clean), ("spiked", spiked)):
        run = out / name
        code = _train(args.config, run, [*args.set, f"data.path={data}", "data.shuffle=false"])
        evs = _events(run)
        final = next((e for e in reversed(evs) if e["event"] == "run_complete" and "final_loss" in e), {})
        rows[name] = final.get("final_loss")
        print(f"\n{name}: exit {code}, final loss {final.get('final_loss')}")
        for e in evs:
            if e["event"] in ("spike_detected", "spike_exit", "rewind", "skip", "soften", "runbook_gave_up"):
                print("  " + json.dumps({k: v for k, v in e.items() if k not in ("time", "by")}))
    if rows.get("clean") and rows.get("spiked"):
        print(
            f"\nfinal loss clean {rows['clean']:.4f}  spiked+runbook {rows['spiked']:.4f}  "
            f"ratio {rows['spiked'] / rows['clean']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
