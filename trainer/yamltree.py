"""Typed dataclass trees from YAML: a file of differences from the defaults plus dotted `--set key=value`
overrides, each value coerced to the type its dataclass field declares, and the rules a field declares on its
type (`Positive[int]`, `Annotated[str, OneOf(...)]`) checked once the tree is built. Every mistake is one
ConfigError naming the key (or the file, line and column) and the fix. Generic: trainer.config declares the tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml


class ConfigError(ValueError):
    """A user mistake in the config or its inputs; the CLI prints it as one line and exits 2."""


@dataclasses.dataclass(frozen=True)
class Range:
    """A number's allowed values, declared on its field's type and said as the message does: "> 0", ">= 1",
    "in (0, 1]". `brackets`: "(" or ")" leaves that end out. A one-sided bound is broken only by a value
    below it; an interval holds only what lies inside it."""

    low: float
    high: float = math.inf
    brackets: str = "[)"

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.brackets[0] == '(' else '>='} {self.low:g}"
        return f"in {self.brackets[0]}{self.low:g}, {self.high:g}{self.brackets[1]}"

    def broken(self, v: float) -> str | None:
        if self.high == math.inf:
            ok = not (v < self.low or (self.brackets[0] == "(" and v == self.low))
        else:
            above = v > self.low if self.brackets[0] == "(" else v >= self.low
            ok = above and (v < self.high if self.brackets[1] == ")" else v <= self.high)
        return None if ok else f"must be {self}, got {v}"


class OneOf:
    """The values a string field may take, said as "must be a, b or c"."""

    def __init__(self, *options: str):
        self.options = options

    def broken(self, v: str) -> str | None:
        say = f"{', '.join(self.options[:-1])} or {self.options[-1]}"
        return None if v in self.options else f"must be {say}, got {v!r}"


T = TypeVar("T")
Positive = Annotated[T, Range(0, brackets="()")]  # > 0
NonNegative = Annotated[T, Range(0)]  # >= 0 (0 usually means off or none)


class Section:
    """A dataclass of config keys. `check_section` checks the rules its fields' types declare, then check()."""

    def check(self, where: str) -> None:
        """The rules between this section's own fields; `where` is its key ("model", "faults[0]")."""


@functools.cache
def _rules(cls: type) -> tuple[tuple[str, tuple], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple((f.name, getattr(hints[f.name], "__metadata__", ())) for f in dataclasses.fields(cls))


def check_section(section: Section, where: str) -> None:
    """The first broken rule of a built section as a ConfigError naming its key: the fields' declared rules in
    the order of the fields, then the section's own check()."""
    for name, rules in _rules(type(section)):
        for rule in rules:
            if (why := rule.broken(getattr(section, name))) is not None:
                raise ConfigError(f"{where}.{name} {why}")
    section.check(where)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the declared type, or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item_t,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_t, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        return value
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return build(typ, value, key)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {typ} at {key}")


def build(cls: type, values: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in values:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            raise ConfigError(f"unknown config key '{where}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix}: {e}") from None


def set_dotted(tree: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected dotted.key=value")
    key, raw = dotted.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: the value is not valid YAML ({_yaml_cause(e)})") from None
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{p}' is not a section")
    node[parts[-1]] = value


def _yaml_cause(e: yaml.YAMLError) -> str:
    """PyYAML's own words for what is wrong and where (1-based), with the fix for the usual culprits."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    hint = (
        "; indent with spaces: YAML does not allow tabs"
        if "'\\t'" in problem
        else ("; is it a YAML text file?" if isinstance(e, yaml.reader.ReaderError) else "")
    )  # e.g. a NUL byte
    return f"{where}{problem}{hint}"


def read_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"--config {path} is a directory; pass a YAML file, e.g. configs/tiny.yaml"
            if p.is_dir()
            else f"config file not found: {path} (pass an existing YAML, e.g. configs/tiny.yaml)"
        )
    try:
        tree = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not a UTF-8 text file (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"pass a YAML config such as configs/tiny.yaml, saved as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_cause(e)})") from None
    if not isinstance(tree, dict | None):
        raise ConfigError(f"{path}: top level must be a mapping of sections, like configs/tiny.yaml")
    return tree or {}
