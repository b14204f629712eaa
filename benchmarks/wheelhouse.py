"""The wheels the GPU machine lacks, built here for its Python (3.12, x86-64, manylinux) into a git-ignored
folder that a device call carries (issue 47; benchmarks/gpu_check.py says how it is used).

    python benchmarks/wheelhouse.py            # .whl/: every runtime dependency of this project, with everything
                                               # it needs in turn, that the GPU image does not hold (DEVICE_HAS)
    python benchmarks/wheelhouse.py --full     # also .whl-image/: the rest of the closure (jax for CPU, flax,
                                               # optax, orbax, ...), stand-ins for what the image holds
    python benchmarks/wheelhouse.py --prove    # --full, then a fresh Python 3.12 venv that gets .whl-image/ as
                                               # its "image" and .whl/ exactly as the device command installs it
                                               # (--no-index), `pip check`, and gpu_check.py --cpu-smoke there

How: pip resolves pyproject.toml's dependencies for cp312 on manylinux x86-64 (`pip install --dry-run
--report`, nothing installed), the closure is split by DEVICE_HAS, and `pip download --no-deps
--only-binary=:all:` fetches each wheel at the resolved version; wheels of other versions in the folder are
removed (two versions of one package stop the whole install). The device subset must stay well under the
64 MiB a device call carries; it is checked. Both folders are in .gitignore. Bad input or a failed step: one
line on stderr, exit 1 (2 for usage).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_DIR, IMAGE_DIR = ROOT / ".whl", ROOT / ".whl-image"
CARRY_LIMIT_MIB = 64  # what one device call carries, the working tree included (device README, Limits)
SUBSET_LIMIT_MIB = 32  # ours: half of it, the rest for the tree
PYTHON_VERSION = "3.12"  # the GPU image's python3 (3.12.3)
# manylinux tags pip may take (it matches each exactly): up to glibc 2.35, which both the GPU image (Ubuntu with
# Python 3.12.3) and this machine (Debian 12, glibc 2.36) run, so the same wheels install in the proof here.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(12, 36)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# The GPU image's Python packages (.library/device/KINDS.md, "Python packages already there", read 2026-11-17),
# as pip normalises names. Its jax is 0.11.2 with the CUDA 13 plugin.
DEVICE_HAS = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)


class Failed(RuntimeError):
    """A step that did not work: its one line is what the user sees."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_env() -> dict[str, str]:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_FIND_LINKS", None)  # a local folder this machine's pip config adds: PyPI alone decides here
    return env


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", _pip_env()), **kw)
    if p.returncode != 0:
        last = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise Failed(f"{what} failed (exit {p.returncode}): {last[0].strip()}")
    return p


def _target_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312"]
    return args + [a for p in PLATFORMS for a in ("--platform", p)]


def requirements() -> list[str]:
    """pyproject.toml's runtime dependencies (no extras: the image has nvidia-ml-py for the cuda12 one)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def resolve(reqs: list[str]) -> dict[str, str]:
    """name -> version of the whole closure of `reqs` for the GPU machine's Python and platform."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report"]
        cmd += [str(report), "--target", str(Path(tmp) / "t"), *_target_args(), *reqs]
        _run(cmd, "resolving the dependencies (pip install --dry-run)")
        found = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in found}


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def download(pins: dict[str, str], into: Path) -> list[Path]:
    """Exactly these wheels in `into`: other versions and packages removed, the missing ones fetched."""
    into.mkdir(parents=True, exist_ok=True)
    for whl in into.glob("*.whl"):
        name, version = _wheel_name(whl)
        if pins.get(name) != version:
            whl.unlink()
    if pins:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *_target_args(), "-d", str(into)]
        _run(cmd + [f"{n}=={v}" for n, v in sorted(pins.items())], f"downloading {len(pins)} wheels into {into}")
    wheels = sorted(into.glob("*.whl"))
    have = {_wheel_name(w)[0] for w in wheels}
    if missing := sorted(set(pins) - have):
        raise Failed(f"no wheel in {into} for {', '.join(missing)}")
    if len(wheels) != len(have):
        raise Failed(f"{into} holds two versions of one package: {[w.name for w in wheels]}")
    return wheels


def mib(wheels: list[Path]) -> float:
    return sum(w.stat().st_size for w in wheels) / 2**20


def build(full: bool) -> dict:
    pins = resolve(requirements())
    device = {n: v for n, v in pins.items() if n not in DEVICE_HAS}
    wheels = download(device, DEVICE_DIR)
    if mib(wheels) > SUBSET_LIMIT_MIB:
        raise Failed(f"{DEVICE_DIR} holds {mib(wheels):.1f} MiB, over the {SUBSET_LIMIT_MIB} MiB kept for it")
    out = {"device": {"dir": str(DEVICE_DIR), "wheels": [w.name for w in wheels], "mib": round(mib(wheels), 2)}}
    if full:
        image = download({n: v for n, v in pins.items() if n in DEVICE_HAS}, IMAGE_DIR)
        out["image"] = {"dir": str(IMAGE_DIR), "wheels": len(image), "mib": round(mib(image), 1)}
    return out


def _python312(arg: str | None) -> str:
    """--python, else the first Python 3.12 that answers: pyenv's 3.12.1 (this machine), python3.12 on PATH."""
    cands = [arg] if arg else [f"/root/.pyenv/versions/{PYTHON_VERSION}.1/bin/python", shutil.which("python3.12")]
    for cand in filter(None, cands):
        try:
            v = _run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], f"{cand} -c").stdout.strip()
        except (Failed, OSError):
            if arg:
                raise
            continue
        if v == PYTHON_VERSION:
            return cand
        if arg:
            raise Failed(f"--python {arg} is Python {v}, not {PYTHON_VERSION}")
    raise Failed(f"no Python {PYTHON_VERSION} found (pass --python PATH)")


def prove(python: str, work: Path) -> dict:
    """A fresh venv of the GPU machine's Python: .whl-image/ stands in for its image, .whl/ goes in the way the
    device command installs it, both with --no-index; `pip check`, then gpu_check --cpu-smoke."""
    shutil.rmtree(work, ignore_errors=True)
    venv, site, smoke = work / "venv", work / "site", work / "smoke"
    _run([python, "-m", "venv", str(venv)], "creating the venv")
    py = str(venv / "bin" / "python")
    image, device = sorted(IMAGE_DIR.glob("*.whl")), sorted(DEVICE_DIR.glob("*.whl"))
    _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, image)], "installing .whl-image/")
    # the device command, verbatim but for the paths
    cmd = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), *map(str, device)]
    _run(cmd, "installing .whl/ (the device command)")
    env = dict(_pip_env(), PYTHONPATH=f"{site}:{ROOT}")
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    _run([py, "-m", "pip", "check"], "pip check (every requirement of every installed package met)", env=env)
    imports = "import grain, array_record, portpicker, tensorboardX, jax, flax, optax, orbax.checkpoint, trainer"
    _run([py, "-c", imports], "importing the stack", env=env, cwd=work)
    cmd = [py, "benchmarks/gpu_check.py", "--cpu-smoke", "--work", str(smoke), "--out", str(smoke / "out")]
    _run(cmd, "gpu_check.py --cpu-smoke in the venv", env=env, cwd=ROOT, timeout=1800)
    r = json.loads((smoke / "out" / "gpu.json").read_text())
    bad = {k: v for k, v in r.items() if isinstance(v, dict) and ("error" in v or "skipped" in v) and k != "preflight"}
    if bad:
        raise Failed(f"gpu_check --cpu-smoke in the venv: parts failed or skipped: {json.dumps(bad)[:600]}")
    return {
        "python": _run([py, "--version"], "python --version").stdout.strip(),
        "venv": str(venv),
        "image_wheels": len(image),
        "device_wheels": len(device),
        "device_mib": round(mib(device), 2),
        "smoke_wall_s": r.get("wall_s"),
        "bitwise_equal": r.get("bitwise_resume", {}).get("bitwise_equal"),
        "attention": r.get("attention"),
        "parts": {
            k: ("ok" if "error" not in v else "error") for k, v in r.items() if isinstance(v, dict) and "part_s" in v
        },
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also .whl-image/: the closure's packages the image holds")
    p.add_argument("--prove", action="store_true", help="--full, then the offline install and smoke in a 3.12 venv")
    p.add_argument("--python", default=None, help=f"the Python {PYTHON_VERSION} for --prove (default: found)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trainer-wheelhouse-proof")
    args = p.parse_args(argv)
    try:
        python = _python312(args.python) if args.prove else None
        result = build(full=args.full or args.prove)
        print(
            f"{DEVICE_DIR}: {len(result['device']['wheels'])} wheels, {result['device']['mib']} MiB:", file=sys.stderr
        )
        print("  " + " ".join(result["device"]["wheels"]), file=sys.stderr)
        if args.prove:
            result["proof"] = prove(python, args.work)
    except (Failed, OSError, subprocess.SubprocessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
