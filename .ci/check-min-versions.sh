#!/usr/bin/env bash
# Proves pyproject.toml's dependency minimums: a fresh venv holding exactly the versions in
# .ci/min-versions.txt (the rest resolved by pip) runs the fast test subset. Not part of .ci/run.
# Usage: bash .ci/check-min-versions.sh [extra pytest args]   (VENV=... to place the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/trainer-min-versions-venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
rm -rf "$VENV" && "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --only-binary=:all: -c .ci/min-versions.txt -e '.[test]'
"$VENV/bin/python" - <<'PY'  # the constraints hold: every pinned package is installed at its pin
from importlib.metadata import version
pins = [l.split("==") for l in open(".ci/min-versions.txt") if "==" in l and not l.startswith("#")]
bad = [f"{n}: {version(n)} != {v.strip()}" for n, v in pins if version(n) != v.strip()]
assert not bad, bad
print("python", __import__("sys").version.split()[0], "|", " ".join(f"{n}=={v.strip()}" for n, v in pins))
PY
# CI=true turns "torch is not installed" skips into failures; this venv has no torch by design
env -u CI "$VENV/bin/python" -m pytest -q tests -m "not slow" -x "$@"
