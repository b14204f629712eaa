"""Config: shipped configs build models of their stated size; bad input fails cleanly with exit 2."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, child_env, run_trainer, sets, trainer_cmd

import trainer.config
from trainer.config import Config, ConfigError, load_config
from trainer.faults import corrupt
from trainer.model.model import GPT
from trainer.observe import heartbeat
from trainer.store import event_names as E

# Stated sizes (millions of parameters) of every shipped config.
STATED = {
    "tiny.yaml": 1.9,
    "gpt2-124m.yaml": 124,
    "gpt-1b.yaml": 1000,
    "gpt-7b.yaml": 6700,
    "llama-tiny.yaml": 1.72,
    "llama-150m.yaml": 153,
    "llama-1b.yaml": 1000,
    "llama-8b.yaml": 8030,  # Llama 3 8B: 8,030,261,248
}


def test_every_shipped_config_parses_and_has_its_stated_size():
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert shipped == sorted(STATED), "a config was added or removed: state its size here"
    for name, millions in STATED.items():
        cfg = load_config(str(ROOT / "configs" / name))
        tokens = jnp.zeros((1, cfg.model.seq_len), jnp.int32)
        shapes = jax.eval_shape(lambda c=cfg, t=tokens: GPT(c.model).init(jax.random.key(0), t))
        n = sum(x.size for x in jax.tree.leaves(shapes)) / 1e6
        assert abs(n - millions) / millions < 0.05, f"{name}: {n:.1f}M params, stated {millions}M"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.widht=3", "unknown config key 'model.widht'"),
        ("train.steps=ten", "train.steps: expected an integer"),
        ("model.d_model=0", "model.d_model must be > 0"),
        ("data.batch_size=-4", "data.batch_size must be > 0"),
        ("log.tensorboard=maybe", "log.tensorboard: expected true/false"),
        ("model.compute_dtype=fp8", "model.compute_dtype must be float32 or bfloat16"),
        ("model.remat=true", "model.remat must be one of none, full, save_dots, save_attention, got 'True'; true is"),
        ("train.microbatches=0", "train.microbatches must be > 0"),
        ("faults=[{kind: crash, step: 3, phase: restore}]", "faults[0].phase must be one of step, startup, restore"),
        ("faults=[{kind: hang, step: 3, phase: shutdown}]", "faults[0].phase must be one of"),
        ("faults=[{kind: corrupt, step: 3}]", "faults[0].how is for corrupt only, one of flip, truncate, torn"),
        ("faults=[{kind: crash, step: 3, how: flip}]", "faults[0].how is for corrupt only"),
        ("model.arch=mamba", "model.arch must be one of gpt2, llama, got 'mamba'"),
        ("model.n_kv_heads=4", "model.n_heads (6) must be a multiple of model.n_kv_heads (4)"),
        ("model.position=alibi", "model.position must be learned or rope, got 'alibi'"),
        ("model.mlp=relu", "model.mlp must be gelu or swiglu"),
        ("run.gpu_mem_fraction=1.5", "run.gpu_mem_fraction must be in (0, 1] or 0 (jax's default), got 1.5"),
        ("run.xla_latency_hiding=sometimes", "run.xla_latency_hiding: expected true/false"),
        ("train.z_loss=-1", "train.z_loss must be >= 0"),
        ("model.dropout=1", "model.dropout must be in [0, 1), got 1.0"),
        ("runbook.lr_factor=0", "runbook.lr_factor must be in (0, 1], got 0.0"),
        ("alerts.throughput_drop=1", "alerts.throughput_drop must be in (0, 1), got 1.0"),
        ("straggler.windows=0", "straggler.windows must be >= 1, got 0"),
        ("launch.mode=k8s", "launch.mode must be local or slurm, got 'k8s'"),
        ("faults=[{kind: crash, step: 3, process: 2}]", "faults[0].process must be in [0, launch.processes=1), got 2"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(ROOT / "configs" / "tiny.yaml"), [override])


def test_each_section_checks_its_own_fields_and_each_vocabulary_has_one_owner():
    """A section's check() names keys as {where}.FIELD (its own key, from the tree): each FIELD is one of its
    fields. The phases and the corruption kinds are the config's, wherever they are used."""
    sections = [f.type for f in dataclasses.fields(Config) if f.name != "faults"] + ["Fault"]
    for cls in (getattr(trainer.config, name) for name in sections):
        names = {f.name for f in dataclasses.fields(cls)}
        src = inspect.getsource(cls.check) if "check" in vars(cls) else ""
        assert set(re.findall(r"\{where\}\.(\w+)", src)) <= names, cls
    assert heartbeat.Phase is trainer.config.Phase and set(trainer.config.FAULT_PHASES) < set(heartbeat.Phase)
    sc = trainer.config.SupervisorConfig()
    assert all(isinstance(p.timeout(sc), float) for p in trainer.config.Phase)  # each names a real field
    assert tuple(corrupt.HOW) == trainer.config.CORRUPT_HOW
    assert all(corrupt.HOW[how].__name__ == how for how in corrupt.HOW)


def test_model_arch_sets_its_parts_and_each_stays_settable():
    llama = load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.arch=llama"]).model
    parts = ("position", "norm", "mlp", "bias", "tie_embeddings")
    assert tuple(getattr(llama, k) for k in parts) == ("rope", "rmsnorm", "swiglu", False, False)
    gpt2 = load_config(str(ROOT / "configs" / "tiny.yaml")).model
    assert tuple(getattr(gpt2, k) for k in parts) == ("learned", "layernorm", "gelu", True, True)
    mixed = load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.arch=llama", "model.tie_embeddings=true"]).model
    assert mixed.tie_embeddings and mixed.norm == "rmsnorm"
    with pytest.raises(ConfigError, match=re.escape("model.position=rope needs an even head dim")):
        load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.arch=llama", "model.n_heads=64"])


def _tree_state(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_leaves_the_run_dir_untouched(tmp_path):
    run = tmp_path / "run"
    # Stopped at 10 of the micro config's 30 steps: the same compiled step as every micro run (a cache hit).
    run_trainer(run, "train.stop_at_step=10", "checkpoint.every_steps=5", worker=True)
    before = _tree_state(run)
    cases = [
        (trainer_cmd(run, "model.nope=1")[3:], "unknown config key 'model.nope'"),
        (trainer_cmd(run, "train.steps=abc")[3:], "train.steps: expected an integer"),
        (trainer_cmd(run, "model.n_layers=-1")[3:], "model.n_layers must be > 0"),
        (["--config", str(tmp_path / "missing.yaml"), *sets(f"run.dir={run}")], "config file not found"),
        (trainer_cmd(run, f"data.path={tmp_path}/no_such_corpus")[3:], "data.path not found"),
        # Incompatible resume: a different model shape, under the supervisor and unsupervised.
        (trainer_cmd(run, "model.d_model=96", "model.n_heads=4")[3:], "cannot resume"),
        (trainer_cmd(run, "model.d_model=96", worker=True)[3:], "cannot resume"),
        (trainer_cmd(run, "data.batch_size=32")[3:], "data.batch_size changed"),
        # The seed and the data order decide which data the checkpoint was trained on: refused too. (Other
        # training data: tests/test_eval.py.)
        (trainer_cmd(run, "run.seed=1")[3:], "run.seed changed from 0 to 1"),
        (trainer_cmd(run, "data.shuffle=false", worker=True)[3:], "data.shuffle changed from True to False"),
        (trainer_cmd(run, "train.microbatches=3")[3:], "must be divisible by train.microbatches (3)"),
        (trainer_cmd(run, "checkpoint.durable_dir=ftp://host/run")[3:], "only s3:// and gs:// buckets are supported"),
        (
            trainer_cmd(run, "checkpoint.durable_dir=s3://b/run", "checkpoint.verify=false")[3:],
            "the content manifests are the commit markers",
        ),
    ]
    for args, message in cases:
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert _tree_state(run) == before, f"{args} changed the run dir"


@pytest.mark.slow
def test_harmless_change_resumes_and_is_logged(tmp_path):
    run = tmp_path / "run"
    run_trainer(run, "checkpoint.every_steps=5", worker=True)  # the micro config's 30 steps: compiled once a session
    # jax logs each hit (log_compiles) and miss (explain_cache_misses) of its compilation cache
    logged = {"JAX_LOG_COMPILES": "true", "JAX_EXPLAIN_CACHE_MISSES": "true"}
    longer = run_trainer(run, "train.steps=32", "checkpoint.every_steps=5", worker=True, env=logged)
    from conftest import events

    changed = [e for e in events(run) if e["event"] == E.CONFIG_CHANGED]
    assert any("'steps': 32" in e["change"] for e in changed)
    assert [e["step"] for e in events(run) if e["event"] == E.RESTORE] == [30]
    # A longer run is the same executable: the schedule is the step's input (trainer.train.optim.lr_table), so the
    # resume loads the step the 30-step run compiled instead of compiling one for 32 steps
    hit = "Persistent compilation cache hit for 'jit_train_step'"
    assert hit in longer.stderr and "MISS for 'jit_train_step'" not in longer.stderr, longer.stderr[-3000:]
