"""Interleaved runs of ours (jaxlib 0.10.2), ours (jax/jaxlib 0.12.0.1) and MaxText 0.2.5 at fsdp8 (or 1dev), with the
process's CPU time sampled every 0.1 s (/proc/PID/stat utime+stime): besides tokens/s (wall, median of steps 6-35,
as bench_maxtext.py), each run reports CPU-seconds per step between step 5 and step 35, which the other jobs on
this shared 2-core machine disturb far less than wall time.
usage: python3 bench_cpu.py SETTING ROUNDS OUTDIR"""

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("M", "../shared/peer/maxtext"))  # the peer harness folder (bench_maxtext.py)
import bench_maxtext as B

# $PEER/trainer: a clone with its .venv (jaxlib 0.10.2); $PEER/ours-jax12: a 3.12 venv with jax 0.12.0.1 and the clone;
# $PEER/maxtext-venv: MaxText 0.2.5 (../shared/peer/maxtext/README.md)
PEER = Path(os.environ["PEER"])
TR = PEER / "trainer"
setting, rounds, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
PY = {"ours_j010": str(TR / ".venv/bin/python"), "ours_j012": str(PEER / "ours-jax12/bin/python")}
TCK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK  # utime, stime (fields 14, 15)


def run_sampled(cmd, log, env, cwd):
    samples = []
    with open(log, "wb") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        while p.poll() is None:
            try:
                samples.append((time.time(), cpu_of(p.pid)))
            except Exception:
                pass
            time.sleep(0.1)
    if p.returncode:
        raise RuntimeError(f"{cmd[:4]} exited {p.returncode}: {log}")
    return samples


def cpu_at(samples, t):
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
    raise ValueError("time outside samples")


def ours(tag, who, ov):
    run_dir = out / f"{who}-{tag}"
    sets = [a for o in (f"run.dir={run_dir}", *B.OURS, *ov, "train.steps=35") for a in ("--set", o)]
    cmd = [PY[who], "-m", "trainer", "--config", "configs/tiny.yaml", *sets, "--worker"]
    s = run_sampled(cmd, out / f"{who}-{tag}.log", dict(os.environ, PYTHONUNBUFFERED="1"), TR)
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    st = {e["step"]: e for e in evs if e["event"] == "step"}
    t5, t35 = st[5]["time"], st[35]["time"]
    return {
        "tokens_per_s": statistics.median(e["tokens_per_s"] for k, e in st.items() if k > 5),
        "cpu_s_per_step": (cpu_at(s, t35) - cpu_at(s, t5)) / 30,
        "wall_s_per_step": (t35 - t5) / 30,
        "final_loss": st[35]["loss"],
    }


def maxtext(tag, dev, extra):
    py = str(PEER / "maxtext-venv/bin/python")
    base = subprocess.check_output(
        [py, "-c", "import maxtext,os;print(os.path.dirname(maxtext.__file__))"], text=True
    ).strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    if dev > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={dev}"
    args = [
        f"run_name=mt-{tag}",
        f"base_output_directory={out / 'mt-out'}",
        *B.MT,
        f"per_device_batch_size={16 // dev}",
        "steps=35",
        *extra,
    ]
    log = out / f"maxtext-{tag}.log"
    s = run_sampled([py, "-m", "maxtext.trainers.pre_train.train", base + "/configs/base.yml", *args], log, env, out)
    st = {}
    for m in re.finditer(
        r"I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*?completed step: (\d+), seconds: ([0-9.]+).*?loss: ([0-9.]+)",
        log.read_text(),
    ):
        day = datetime.datetime.now().astimezone()
        ts = day.replace(
            month=int(m[1]), day=int(m[2]), hour=int(m[3]), minute=int(m[4]), second=0, microsecond=0
        ).timestamp() + float(m[5])
        st[int(m[6]) + 1] = (ts, float(m[7]), float(m[8]))
    t5, t35 = st[5][0], st[35][0]
    return {
        "tokens_per_s": statistics.median(16 * 256 / v[1] for k, v in st.items() if k > 5),
        "cpu_s_per_step": (cpu_at(s, t35) - cpu_at(s, t5)) / 30,
        "wall_s_per_step": (t35 - t5) / 30,
        "final_loss": st[35][2],
    }


ov, dev, extra = B.SETTINGS[setting]
whos = [*PY, "maxtext"]
runs = []
for r in range(rounds):
    order = whos[r % 3 :] + whos[: r % 3]
    for who in order:
        tag = f"{setting}-r{r}"
        t = time.time()
        cpu0, kids0 = B.cpu_busy_s(), B.children_cpu_s()
        rec = maxtext(tag, dev, extra) if who == "maxtext" else ours(tag, who, ov)
        others = (B.cpu_busy_s() - cpu0) - (B.children_cpu_s() - kids0)
        rec.update(round=r, setting=setting, who=who, started=t, others_cores=max(others, 0.0) / (time.time() - t))
        runs.append(rec)
        print(json.dumps(rec), flush=True)
summ = {}
for who in whos:
    xs = [x for x in runs if x["who"] == who]
    summ[who] = {
        k: statistics.median(x[k] for x in xs)
        for k in ("tokens_per_s", "cpu_s_per_step", "wall_s_per_step", "others_cores")
    }
for who in whos[:2]:
    summ[f"{who}/maxtext"] = {
        "tokens_per_s": summ[who]["tokens_per_s"] / summ["maxtext"]["tokens_per_s"],
        "cpu_per_step_maxtext_over_ours": summ["maxtext"]["cpu_s_per_step"] / summ[who]["cpu_s_per_step"],
    }
(out / "bench_cpu.json").write_text(
    json.dumps({"command": " ".join(sys.argv), "runs": runs, "summary": summ}, indent=1) + "\n"
)
print(json.dumps(summ, indent=1))
