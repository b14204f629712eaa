"""`python -m trainer drill --config FILE [--set KEY=VALUE ...] [--minutes M] [--mtbf SECONDS] [--faults KINDS]
[--seed K] [--min-faults 8] [--min-kinds 4]`: will this configuration survive weeks of things breaking, and what
will the breakage cost?

It calibrates (a short run: step time, start-up), plans a seeded Poisson schedule of faults at the given mean
time between failures for about M minutes of drilling (grown, at the same mean time, to hold at least
--min-faults faults of --min-kinds kinds; refused, one line and exit 2, when the minutes cannot hold them at
the hang timeouts and restarts it prices), runs the configuration under it (supervised, as it
would train; the drill sends the preemptions and requeues the job), then runs the same steps undisturbed
and checks: every fault detected and healed, data consumed exactly once, the final params bit-for-bit the
undisturbed run's, the ledger's goodput against the survival model's prediction, and the setup. Table on
stdout, DIR/drill.json and DIR/drill.png; exit 0 only if every check holds, else one line per failed check.
Everything runs in its own directory (printed); the configuration's run dir is never touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from trainer.config import ConfigError, load_config
from trainer.drill import checks, page, plan, run
from trainer.drill.kinds import KINDS, available
from trainer.observe.events import read_events
from trainer.store import env_vars, rundir
from trainer.store import summary as run_summary
from trainer.supervise import exit_codes, nodes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer drill", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the configuration to drill (YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--minutes", type=float, default=20.0, help="how long to drill (the drilled run alone)")
    p.add_argument(
        "--mtbf", type=float, default=40.0, metavar="SECONDS", help="mean seconds of training between faults"
    )
    p.add_argument("--faults", default="", metavar="KINDS", help=f"comma-separated, of: {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-faults",
        type=int,
        default=plan.MIN_FAULTS,
        metavar="N",
        help="fewer faults planned or fired fail the drill: they show nothing about a configuration",
    )
    p.add_argument("--min-kinds", type=int, default=plan.MIN_KINDS, metavar="N", help="the same, for kinds")
    p.add_argument("--dir", default="", help="the drill's directory (default: RUN_DIR-drill-DATE-TIME)")
    scale = p.add_argument_group("projection to the real run (as `survival` takes it)")
    scale.add_argument("--gpus", type=int, default=1024)
    scale.add_argument("--gpu-mtbf-hours", type=float, default=50_000.0)
    scale.add_argument("--days", type=float, default=21.0)
    return p


def _spares(cfg) -> int | None:
    """Under SLURM (launch.mode slurm, as launch/slurm.sbatch sets it), the allocation's nodes beyond the
    configuration's; None outside an allocation."""
    if cfg.launch.mode != "slurm":
        return None
    if not os.environ.get(env_vars.SLURM_JOB_ID):
        raise ConfigError(
            "launch.mode is slurm but this is not inside a SLURM allocation: run the drill as a job "
            "(sbatch --nodes=N launch/slurm.sbatch drill --config ...) or with launch.mode=local"
        )
    allocated = nodes.hostnames(os.environ.get(env_vars.SLURM_JOB_NODELIST, ""))
    return len(allocated) - -(-cfg.launch.processes // cfg.launch.processes_per_node)


def _kinds(cfg, asked: str, spares: int | None) -> list[str]:
    can, why = available(cfg, spares)
    if not asked:
        return can
    kinds = [k.strip() for k in asked.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            raise ConfigError(f"--faults: unknown kind {k!r}; one of {', '.join(KINDS)}")
        if k in why:
            raise ConfigError(f"--faults: {k} cannot be drilled with this config: {why[k]}")
    return kinds


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        spares = _spares(cfg)
        kinds = _kinds(cfg, args.faults, spares)
        # before anything runs: the mean time between failures and the hang timeouts alone may not fit
        plan.check(cfg, kinds, **_sizing(args), named=bool(args.faults))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except plan.Refused as e:
        print(f"drill: refused: {e}", file=sys.stderr)
        return 2
    work = Path(args.dir or f"{cfg.run.dir}-drill-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if work.exists() and any(work.iterdir()):
        print(f"error: --dir {work} is not empty: a drill starts in a directory of its own", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    print(f"drill: in {work} (the configuration's run dir {cfg.run.dir} is not touched)", flush=True)
    if spares is not None:
        print(
            f"drill: inside SLURM job {os.environ[env_vars.SLURM_JOB_ID]}: {cfg.launch.processes} processes, "
            f"{spares} spare node(s); every run goes through srun on the allocation",
            flush=True,
        )
    try:
        return _drill(cfg, kinds, work, args, spares or 0)
    except run.DrillError as e:
        print(f"drill: FAILED: {e}", file=sys.stderr)
        return 1
    except plan.Refused as e:  # after the calibration, before the drilled run: nothing else ran
        print(f"drill: refused: {e}", file=sys.stderr)
        return 2


def _sizing(args) -> dict:
    return dict(minutes=args.minutes, mtbf_s=args.mtbf, min_faults=args.min_faults, min_kinds=args.min_kinds)


def _drill(cfg, kinds: list[str], work: Path, args, spares: int) -> int:
    cal = run.calibrate(cfg, work)
    measured = dict(step_s=cal["step_s"], startup_s=cal["startup_s"])
    sized = plan.size(cfg, kinds, **_sizing(args), **measured, seed=args.seed, spares=spares)
    steps, schedule = sized.steps, sized.plan
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, stop_at_step=0))
    print(
        f"drill: calibrated {cal['step_s'] * 1e3:.0f} ms a step, start-up {cal['startup_s']:.1f} s; {steps} steps, "
        f"{len(schedule)} faults planned ({', '.join(sorted({p.kind for p in schedule}))}), seed {args.seed}; "
        f"~{sized.priced_s / 60:.1f} min priced",
        flush=True,
    )
    if sized.grown_from:
        print(
            f"drill: grown from the {sized.grown_from} steps --minutes {args.minutes:g} gave to {steps}, at the same "
            f"mean time between failures ({args.mtbf:g} s), to hold {args.min_faults} faults of {args.min_kinds} kinds",
            flush=True,
        )
    limit = max(4 * sized.priced_s, 4 * args.minutes * 60, 900)
    drilled = run.drilled(cfg, schedule, work, limit_s=limit)
    then = "now the undisturbed run of the same steps, after it" if drilled["exit_code"] == 0 else "it did not finish"
    print(f"drill: drilled run ended (exit {drilled['exit_code']}) after {drilled['wall_s']:.0f} s; {then}", flush=True)
    try:
        if drilled["exit_code"] != 0:  # no final params to compare: the lines below say why it stopped
            raise run.DrillError("not run: the drilled run did not finish")
        ref = run.reference(cfg, work, limit_s=limit)
    except (run.DrillError, OSError) as e:  # e.g. the disk the drilled run filled: the checks say what they can
        ref = {"wall_s": 0.0, "skips": [], "softened": False, "error": str(e)}
    run_dir, ref_dir = work / "run", work / "reference"
    evs = read_events(run_dir / rundir.EVENTS)
    fired = run.fired(run_dir)
    rows = checks.faults(schedule, fired, drilled["preempts"], evs)
    summary = run_summary.read(run_dir) or {}
    gp = checks.goodput(summary, rows, cfg, cal["step_s"]) if summary.get("goodput") else None
    dp = checks.data_and_params(run_dir, ref_dir)
    failed = _failed(cfg, drilled, rows, dp, gp, ref)
    failed += checks.coverage(
        schedule, fired, drilled["preempts"], min_faults=args.min_faults, min_kinds=args.min_kinds
    )
    failed += checks.setup(cfg, evs, rows, run_dir)
    costs = checks.costs(evs, summary)
    interval = checks.interval_steps(cfg) * cal["step_s"] / 60 or None
    proj = checks.projection(
        costs, gpus=args.gpus, gpu_mtbf_hours=args.gpu_mtbf_hours, days=args.days, interval_min=interval
    )
    fired_idx = {f["index"] for f in fired}
    with_fault = [p for p in schedule if p.fault is not None]
    unfired = [dataclasses.asdict(p) for i, p in enumerate(with_fault) if i not in fired_idx]
    result = {
        "dir": str(work),
        "calibration": cal,
        "steps": steps,
        "seed": args.seed,
        "mtbf_s": args.mtbf,
        "min_faults": args.min_faults,
        "min_kinds": args.min_kinds,
        "grown_from_steps": sized.grown_from,
        "priced_s": sized.priced_s,
        "launch": cfg.launch.mode,
        "spare_nodes": spares,
        "kinds": kinds,
        "planned": plan.as_dicts(schedule),
        "faults": rows,
        "not_fired": unfired,
        "drilled": drilled,
        "reference": dict(ref, order="after the drilled run"),
        "data_and_params": dp,
        "goodput": gp,
        "projection": proj,
        "failed": failed,
        "passed": not failed,
    }
    _print(result)
    try:
        (work / "drill.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        if evs:
            page.timeline(evs, rows, work / "drill.png")
    except OSError as e:  # the drill's own directory may be on the disk the drilled run filled
        print(f"drill: could not write drill.json / drill.png in {work}: {e.strerror}", file=sys.stderr)
    return 0 if not failed else 1


def _failed(cfg, drilled: dict, rows: list[dict], dp: dict, gp: dict | None, ref: dict) -> list[str]:
    out = []
    if drilled["exit_code"] != 0:
        name = exit_codes.NAMES.get(drilled["exit_code"], "?")
        out.append(
            f"the drilled run did not finish: exit {drilled['exit_code']} ({name}); see run.log in the drill's dir"
        )
    for r in rows:
        if r["detected_by"] is None:
            out.append(f"{r['kind']} at step {r['step']} was never detected")
        elif not r["healed"]:
            out.append(
                f"{r['kind']} at step {r['step']} was detected ({r['detected_by']}) but the run never got past it"
            )
    if ref.get("error"):
        if drilled["exit_code"] == 0:
            out.append(f"no undisturbed run to compare with: {ref['error']}")
    elif ref["softened"]:
        out.append(
            "the spike runbook softened the LR: no undisturbed run matches; space spikes wider (runbook.recur_distance)"
        )
    elif not dp["hash_equal"]:
        out.append(
            f"final params differ from the undisturbed run's ({str(dp['params_sha256'])[:12]} vs "
            f"{str(dp['reference_sha256'])[:12]}): resume is not bit-for-bit"
        )
    if dp["audit_problems"]:
        out.append(f"data not consumed exactly once: {dp['audit_problems'][0]}")
    if gp is None:
        out.append("no goodput to compare: the drilled run's summary.json has no ledger, or no productive step")
    elif drilled["exit_code"] != 0 or not checks.interval_steps(cfg):
        pass  # an unfinished run's ledger, or no checkpoint to price: the lines above and the setup's say why
    elif not gp["within"]:
        every, rc = checks.interval_steps(cfg), gp["recompute_s"]
        priced = rc["model_uniform"] + rc["measured_other"]
        line = (
            f"goodput {gp['measured']:.1%} measured vs {gp['predicted']:.1%} expected by the survival model for the "
            f"same costs (more than {checks.GOODPUT_TOLERANCE:.0%} apart, beyond the {gp['chance_spread_s']:.0f} s "
            f"chance allows): {rc['measured']:.0f} s recomputed where it prices {priced:.0f} s"
        )
        if gp["uniform_failures"] and gp["recomputed_per_uniform"] > every / 2:
            line += (
                f": its {gp['uniform_failures']} failure(s) at a random step recomputed "
                f"{gp['recomputed_per_uniform']:.0f} steps each where it assumes half an interval ({every / 2:g}): a "
                "save that takes longer than checkpoint.every_steps to become durable costs more than the model "
                "prices; lengthen the interval or speed up saves"
            )
        elif rc["measured"] > priced:
            line += " (the steps redone after each restart ran slower than the calibrated step)"
        else:
            line += f" (its {gp['uniform_failures']} failure(s) lost less than half an interval each, beyond chance)"
        out.append(line)
    return out


def _print(result: dict) -> None:
    rows, gp, dp, proj = result["faults"], result["goodput"], result["data_and_params"], result["projection"]
    drilled, ref = result["drilled"], result["reference"]
    print()
    print(page.table(rows))
    kinds = sorted({r["kind"] for r in rows})
    ok = sum(r["healed"] for r in rows)
    print(f"\n{len(rows)} faults of {len(kinds)} kinds fired, {ok} detected and healed", end="")
    print(f"; {len(result['not_fired'])} planned never fired" if result["not_fired"] else "")
    print(
        f"drilled run {drilled['wall_s']:.0f} s in {drilled['sessions']} session(s); "
        f"reference {ref['wall_s']:.0f} s, run after it"
    )
    if dp["params_sha256"] and dp["reference_sha256"]:
        print(
            f"params: {dp['params_sha256'][:16]} drilled, {dp['reference_sha256'][:16]} undisturbed: "
            f"{'equal' if dp['hash_equal'] else 'DIFFERENT'}"
        )
    else:
        print("params: no final params to compare (a run did not finish)")
    print(
        f"audit: {'clean' if not dp['audit_problems'] else dp['audit_problems'][0]} ({dp['audit'].get('steps')} steps, "
        f"{dp['audit'].get('compared_steps')} compared with the reference)"
    )
    if gp:
        print(
            f"goodput: {gp['measured']:.1%} measured, {gp['predicted']:.1%} expected by the survival model for the "
            f"measured costs (failures at a random step: {gp['uniform_failures']}, "
            f"{gp['recomputed_per_uniform']:.0f} steps recomputed each)"
        )
    print(
        f"at your scale ({proj['inputs']['gpus']} GPUs, MTBF {proj['inputs']['mtbf_hours']:.0f} h each, "
        f"{proj['inputs']['days']:g} days): {proj['expected_failures']:.0f} failures, {proj['wasted_gpu_hours']:,.0f} "
        f"GPU-hours wasted ({proj['verdict']}); best checkpoint interval {proj['best_interval_min']:.1f} min"
    )
    print(f"results: {result['dir']}/drill.json, drill.png")
    if result["failed"]:
        print("\nDRILL FAILED:")
        for line in result["failed"]:
            print(f"- {line}")
    else:
        print("\nDRILL PASSED: every check holds")
