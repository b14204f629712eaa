"""The wall between the jax side and the rest: the supervisor, launcher, ledger, status, report, audit and
simulator must keep working when the accelerator stack is broken, so they never import it. Each check runs
in a fresh interpreter where jax and its neighbours cannot be imported at all. And the project's own imports
run one way, down the wall (STYLE.md habit 13), read from the source."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, ROOT, TINY, child_env, sets, summary

import trainer

BLOCKED = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorstore")
JAX_FREE_PACKAGES = ("config", "store", "supervise", "observe", "survival", "corpus", "drill", "faults")
# the checkpoint package's front page (its __init__: a docstring) is read by jax-free code's imports too
JAX_FREE_MODULES = ("trainer.ckpt",)
# Importing a blocked package raises at once, wherever the import statement sits (a lazy one too).
BLOCKER = f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not importable here: jax-free code imported it")
sys.meta_path.insert(0, _Blocked())
"""


def _jax_free(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def _cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    code = f"import runpy; sys.argv = ['trainer', *{list(argv)!r}]; runpy.run_module('trainer', run_name='__main__')"
    return _jax_free(code, timeout=timeout)


def jax_free_modules() -> list[str]:
    top = [str(Path(trainer.__file__).parent)]  # config, yamltree, __main__: the top is jax-free too
    names = [f"trainer.{m.name}" for m in pkgutil.iter_modules(top) if not m.ispkg]
    for pkg in JAX_FREE_PACKAGES:
        path = [str(Path(trainer.__file__).parent / pkg)]
        names += [f"trainer.{pkg}"] + [f"trainer.{pkg}.{m.name}" for m in pkgutil.iter_modules(path)]
    return names + list(JAX_FREE_MODULES)


def test_every_jax_free_module_imports_without_jax():
    modules = jax_free_modules()
    assert len(modules) > 20 and "trainer.supervise.supervisor" in modules
    out = _jax_free(f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_blocker_blocks():
    out = _jax_free("import trainer.model.model")
    assert out.returncode != 0 and "jax-free code imported it" in out.stderr


def test_cli_without_jax_help_survival():
    out = _cli("--help")
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr[-2000:]
    out = _cli("survival", "--sweep", "--json")
    assert out.returncode == 0 and '"sweep"' in out.stdout, out.stderr[-2000:]


def test_prepare_without_jax(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "document {i} " }}\n' * 3 for i in range(40)))
    out = _cli(
        "prepare",
        "--input",
        str(tmp_path / "docs.jsonl"),
        "--tokenizer",
        "bpe:300",
        "--out",
        str(tmp_path / "prepared"),
    )
    assert out.returncode == 0 and (tmp_path / "prepared" / "meta.json").is_file(), out.stderr[-2000:]


@pytest.mark.slow
def test_supervisor_status_report_without_jax(tmp_path):
    """A whole supervised run whose supervisor cannot import jax (its worker, a separate process, can),
    then status and report on the result, just as jax-less."""
    run = tmp_path / "run"
    # The suite's micro config (its compiled step is a cache hit), with the end-of-run report back on.
    micro = [*MICRO, "train.steps=10", "checkpoint.every_steps=5", "log.report=true", f"run.dir={run}"]
    out = _cli("--config", TINY, *sets(*micro), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary(run)["final_step"] == 10 and "goodput" in summary(run)
    assert (run / "report" / "loss.png").is_file()  # the supervisor's end-of-run report, matplotlib and all
    out = _cli("status", str(run))
    assert out.returncode == 0 and "COMPLETE" in out.stdout, out.stderr[-2000:]
    out = _cli("report", str(run), "--out", str(tmp_path / "rep"))
    assert out.returncode == 0 and (tmp_path / "rep" / "goodput.png").is_file(), out.stderr[-2000:]


# Imports run down the wall: a module may import its own package, or a package of a lower rank; never one of
# its own rank or above. The unit is the package (no module of a package has a rank of its own): corpus,
# supervise, survival and faults share a rank, so none of them imports another; each stands on observe, store
# and config alone (the jax side above may use any of them).
RANK = {
    "__init__": -1,  # trainer/__init__.py: the package docstring; imports nothing
    "yamltree": 0,  # the YAML parser under config
    "config": 1,  # imports yamltree and nothing else of the project
    "store": 1.5,  # the floor: on-disk formats and names (run dir, events, env vars, checkpoint files, bucket)
    "observe": 2,  # the run dir's files, their writers and readers
    "xla_env": 2.5,  # every XLA flag and GPU variable the trainer sets (store's env_vars names them): jax-free
    "corpus": 3,
    "supervise": 3,
    "survival": 3,
    "faults": 3,  # the built-in faults, fired inside the worker: jax-free
    "drill": 3.5,  # runs the trainer under faults (supervise, survival, observe): jax-free too
    # the jax side, the worker process: each package stands on those before it
    "parallel": 4,  # the mesh, jax.distributed, the group's agreement
    "model": 4.1,
    "ckpt": 4.2,  # saving and restoring the train state (its jax-free files are store's)
    "train": 4.3,  # the worker: state, step, data, loop
    "tools": 4.4,  # inspect, export, sample
    "__main__": 5,  # the CLI
}


def _unit(dotted: str) -> str:
    """The wall's unit of a trainer module: its package under trainer/, or its top-level module's name."""
    parts = dotted.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imported(module: str, is_package: bool, tree: ast.AST) -> list[tuple[ast.stmt, str]]:
    """(statement, module) of every import of the project in a module's source, those inside functions too;
    not those under `if TYPE_CHECKING:` (annotations only: nothing is imported when the program runs)."""
    out = []
    typing_only = {
        id(n)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and isinstance(top.test, ast.Name) and top.test.id == "TYPE_CHECKING"
        for n in ast.walk(top)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(node, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: len(module.split(".")) - node.level + is_package] if node.level else []
            frm = ".".join(base + ([node.module] if node.module else []))
            # `from trainer import config` imports trainer.config, `from trainer.store import bucket` that module
            package = frm == "trainer" or frm.count(".") == 1 and frm.startswith("trainer.")
            out += [(node, f"{frm}.{a.name}") for a in node.names] if package else [(node, frm)]
    return [(node, m) for node, m in out if m == "trainer" or m.startswith("trainer.")]


def upward_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "trainer").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = _unit(module)
        for node, target in _imported(module, rel.name == "__init__", ast.parse(path.read_text(), str(path))):
            dst = _unit(target)
            if dst == src:
                continue
            where = f"{path.relative_to(root)}:{node.lineno} `{ast.unparse(node)}`"
            if src not in RANK or dst not in RANK:
                bad.append(f"{where}: {src if src not in RANK else dst} has no rank in RANK; give it one")
            elif RANK[dst] >= RANK[src]:
                bad.append(f"{where}: {src} (rank {RANK[src]}) may not import {dst} (rank {RANK[dst]})")
    return bad


def test_imports_run_down_the_wall():
    bad = upward_imports(ROOT)
    assert not bad, "imports going up (or across) the wall:\n" + "\n".join(bad)


def test_no_module_is_a_haystack():
    """Files under ~400 lines: a module that outgrows that holds two concerns (STYLE.md). One at the limit is
    split where its concerns part, never squeezed under it by shortening its text."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "trainer").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 420
    }
    assert not long, f"modules over 420 lines: {long}: split each where its concerns part"


# The packages a reader walks through when a run fails, the supervisor and the worker, keep every function
# readable at a glance.
SHORT_FUNCTIONS = ("trainer/supervise", "trainer/train")


def long_functions(root: Path, folders=SHORT_FUNCTIONS, limit: int = 60) -> dict[str, int]:
    """Every function (methods and nested ones too) of the modules under `folders` longer than `limit` lines,
    def to last line."""
    out = {}
    for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
        file = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit:
                out[f"{file}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_function_over_60_lines_in_the_supervise_and_train_packages():
    assert all((ROOT / folder / "__init__.py").is_file() for folder in SHORT_FUNCTIONS)
    assert not long_functions(ROOT), long_functions(ROOT)


def import_graph(root: Path, unit=lambda module: module) -> dict[str, set[str]]:
    """Which unit imports which among trainer's modules (`unit` maps a module to its unit: itself, or its
    package): every import counts here, those for type annotations only too (a circle of them still means
    two modules that cannot be read one before the other)."""
    mods = {}
    for path in sorted((root / "trainer").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph: dict[str, set[str]] = {unit(m): set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in mods]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".")[: len(m.split(".")) - node.level + is_pkg] if node.level else []
                frm = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{frm}.{a.name}" if f"{frm}.{a.name}" in mods else frm for a in node.names]
            graph[unit(m)] |= {unit(t) for t in targets if t in mods and unit(t) != unit(m)}
    return graph


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle in `graph`, each reported once (as its set of nodes)."""
    cycles, seen = [], set()
    for start in graph:  # a node that reaches itself
        stack, path_ = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop(), path_.pop()
            elif nxt == start:
                if frozenset(path_) not in seen:
                    seen.add(frozenset(path_)), cycles.append(list(path_))
            elif nxt not in path_ and nxt > start:  # only cycles whose smallest node is `start`
                stack.append((nxt, iter(sorted(graph[nxt])))), path_.append(nxt)
    return cycles


def test_no_import_circle_between_modules():
    assert not cycles_of(import_graph(ROOT)), cycles_of(import_graph(ROOT))


def test_no_import_circle_between_packages():
    """The packages under trainer/ form a DAG (annotation-only imports count): a package that reaches itself
    through others cannot be read, tested or moved on its own."""
    graph = import_graph(ROOT, unit=_unit)
    assert {"store", "observe", "ckpt", "supervise", "parallel"} <= set(graph)  # the graph is the packages'
    assert not cycles_of(graph), cycles_of(graph)
