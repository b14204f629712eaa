"""`python -m trainer survival`: price a checkpoint interval on a cluster, sweep for the best one, or take
the measured stall, restart time and MFU of a real run (`--from-run`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from trainer.survival.from_run import load_run
from trainer.survival.model import (
    Inputs,
    exact,
    expectation,
    lost_for_crash,
    monte_carlo,
    recommend_interval_min,
    sweep,
    verdict,
)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, never a usage dump or traceback
        raise _UsageError(message)


def _number(kind: type, low: float, strict: bool, high: float = math.inf) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text!r}")
        return value

    return parse


def _interval(text: str) -> float | None:
    return None if text.strip().lower() == "never" else _number(float, 0, True)(text)


def _parser() -> _Parser:
    p = _Parser(
        prog="python -m trainer survival",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gpus", type=_number(int, 0, True), default=1024, help="GPUs in the job (target cluster size)")
    p.add_argument("--mtbf-hours", type=_number(float, 0, True), default=50_000.0, help="MTBF of one GPU")
    p.add_argument("--interval-min", type=_interval, default=60.0, help="checkpoint interval, or 'never'")
    p.add_argument("--days", type=_number(float, 0, True), default=21.0, help="run length (work, no failures)")
    p.add_argument("--stall-s", type=_number(float, 0, False), default=5.0, help="GPU-visible cost of one save")
    p.add_argument("--restart-min", type=_number(float, 0, False), default=10.0, help="downtime per failure")
    p.add_argument("--mfu", type=_number(float, 0, True, 1), default=0.45, help="MFU of a healthy step (a fraction)")
    p.add_argument("--since-checkpoint-h", type=_number(float, 0, False), help="GPU-hours one such crash loses")
    p.add_argument("--monte-carlo", type=_number(int, 2, False), metavar="N", help="simulate N runs")
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    p.add_argument("--sweep", action="store_true", help="find the interval that minimises wasted GPU-hours")
    p.add_argument("--plot", type=Path, metavar="FILE", help="PNG of the U-curve (implies --sweep)")
    p.add_argument("--from-run", type=Path, metavar="RUN_DIR", help="use a run's measured stall/restart/MFU")
    p.add_argument("--html", type=Path, metavar="FILE", help="self-contained interactive page")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _apply_run(args: argparse.Namespace, explicit_interval: bool) -> tuple[Inputs, dict[str, Any]]:
    if not args.from_run.is_dir():
        raise _UsageError(f"argument --from-run: no such directory: {args.from_run}")
    found, notes = load_run(args.from_run)
    for key, option in (("stall_s", "--stall-s"), ("restart_s", "--restart-min"), ("mfu", "--mfu")):
        if key not in found:
            notes.append(f"{key} not measured: using {option}")
    stall = found.get("stall_s", args.stall_s)
    restart_s = found.get("restart_s", args.restart_min * 60)
    rec = recommend_interval_min(stall_s=stall, restart_s=restart_s, gpus=args.gpus, mtbf_hours=args.mtbf_hours)
    interval = args.interval_min if explicit_interval else rec
    inp = Inputs(args.gpus, args.mtbf_hours, interval, args.days, stall, restart_s / 60, found.get("mfu", args.mfu))
    info = {"run_dir": str(args.from_run), "measured": found, "notes": notes, "recommended_interval_min": rec}
    return inp, info


def build_report(inp: Inputs, args: argparse.Namespace) -> dict[str, Any]:
    model, ex = expectation(inp), exact(inp)
    label, detail = verdict(model, ex)
    inputs = asdict(inp) | {"interval_min": "never" if inp.interval_min is None else inp.interval_min}
    report: dict[str, Any] = {"inputs": inputs, **model, "verdict": label, "verdict_detail": detail, "exact": ex}
    if args.since_checkpoint_h is not None:
        lost = lost_for_crash(args.since_checkpoint_h, inp.gpus)
        report["since_checkpoint"] = {"hours": args.since_checkpoint_h, "lost_gpu_hours": lost}
    if args.sweep or args.plot or args.from_run:
        report["sweep"] = sweep(inp)
    if args.monte_carlo:
        report["monte_carlo"] = monte_carlo(inp, args.monte_carlo, args.seed)
    return report


def _clean(x: Any) -> Any:
    """Strict JSON: non-finite floats become null."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        explicit = any(a == "--interval-min" or a.startswith("--interval-min=") for a in argv)
        inp = Inputs(args.gpus, args.mtbf_hours, args.interval_min, args.days, args.stall_s, args.restart_min, args.mfu)
        run_info = None
        if args.from_run is not None:
            inp, run_info = _apply_run(args, explicit)
    except _UsageError as err:
        print(f"python -m trainer survival: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    report = build_report(inp, args)
    if run_info is not None:
        report["from_run"] = run_info
    # Presentation lives apart; matplotlib is imported only when a plot is asked for.
    from trainer.survival import page

    outputs = (("--plot", args.plot, page.write_plot), ("--html", args.html, page.write_page))
    for flag, path, write in outputs:
        if path is not None:
            try:
                write(inp, path)
            except OSError as err:
                print(f"python -m trainer survival: error: {flag}: {err}", file=sys.stderr)
                return 2
            report.setdefault("written", []).append(str(path))
    print(json.dumps(_clean(report), indent=2) if args.json else page.table(report))
    return 0
