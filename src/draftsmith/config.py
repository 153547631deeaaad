"""Typed configuration: dataclasses whose fields are the CLI flags.

Every command's options live in one dataclass: field name -> ``--flag-name``,
type -> parser type, default -> the only default, ``help`` metadata -> ``--help``
text. ``__post_init__`` validates and names the flag in its error. The same
classes load from YAML (``from_dict``), so a config file and the command line can
never disagree about defaults.
"""

from __future__ import annotations

import argparse
import re
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from draftsmith.errors import DraftsmithError


def opt(default: Any = dataclasses.MISSING, help: str = "", *, positional: bool = False,
        metavar: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with CLI metadata."""
    meta = {"help": help, "positional": positional, "metavar": metavar}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_ranges(cfg: Any, rules: dict[str, tuple[bool, str]]) -> None:
    """Refuse every flag whose rule failed, each with what it must be and the value given.

    ``rules`` maps a flag (``--epochs``, the field ``epochs``) to (whether its value is valid, what
    it must be: ``"> 0"``, ``"in [0, 1)"``)."""
    bad = [f"{flag} must be {need}, got {getattr(cfg, flag[2:].replace('-', '_'))!r}"
           for flag, (ok, need) in rules.items() if not ok]
    if bad:
        raise DraftsmithError("; ".join(bad))


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None`` / ``Optional[X]``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _converter(tp: Any, flag: str):
    if tp is bool:
        def conv(v: Any) -> bool:
            if isinstance(v, bool):
                return v
            s = str(v).lower()
            if s in {"1", "true", "yes", "on"}:
                return True
            if s in {"0", "false", "no", "off"}:
                return False
            raise DraftsmithError(f"{flag}: expected true/false, got {v!r}")
        return conv
    if get_origin(tp) is Literal:
        choices = get_args(tp)

        def conv(v: Any) -> Any:
            if v not in choices:
                raise DraftsmithError(f"{flag}: expected one of {list(choices)}, got {v!r}")
            return v
        return conv
    if tp in (int, float, str, Path):
        def conv(v: Any) -> Any:
            if tp is int and isinstance(v, float) and not v.is_integer():
                raise DraftsmithError(f"{flag}: expected an integer, got {v!r}")
            if tp in (int, float) and isinstance(v, bool):
                raise DraftsmithError(f"{flag}: expected a number, got {v!r}")
            try:
                return tp(v)
            except (TypeError, ValueError):
                raise DraftsmithError(f"{flag}: expected {tp.__name__}, got {v!r}") from None
        return conv
    return lambda v: v


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(cls: type, name: str, value: Any, prefix: str = "") -> Any:
    """Convert a raw value (from YAML or argv) to the declared type of ``cls.name``."""
    flag = prefix + name if prefix else flag_name(name)  # a config key (section.field) or a flag
    tp, optional = _unwrap(_field_types(cls)[name])
    if value is None:
        if optional:
            return None
        raise DraftsmithError(f"{flag}: a value is required")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DraftsmithError(f"{flag}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, prefix=f"{prefix}{name}.")
    if get_origin(tp) in (list, tuple):
        inner = get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            value = [value]
        conv = _converter(inner, flag)
        return type(value)(conv(v) for v in value) if get_origin(tp) is list else tuple(conv(v) for v in value)
    return _converter(tp, flag)(value)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a config dataclass from a mapping; unknown keys are an error that names them."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftsmithError(f"unknown config key(s) {', '.join(prefix + u for u in unknown)}; "
                              f"valid keys: {', '.join(sorted(prefix + n for n in names))}")
    kwargs = {k: coerce(cls, k, v, prefix) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise DraftsmithError(f"{prefix or 'config'}: {e}") from None
    except DraftsmithError as e:
        if not prefix:
            raise
        # validation names command-line flags; inside a config file the key is section.field
        raise DraftsmithError(re.sub(r"--([a-z][a-z0-9-]*)", lambda m: prefix + m.group(1).replace("-", "_"),
                                     str(e))) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise DraftsmithError(f"config file {p} not found")
    if not p.is_file():
        raise DraftsmithError(f"config file {p} is not a regular file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise DraftsmithError(f"config file {p} is not valid YAML: {e}") from None
    if data is None:  # empty, or comments only: most likely not the file meant (the defaults need no file)
        raise DraftsmithError(f"config file {p} is empty; give at least one setting (e.g. `verifier: ...`), "
                              "or leave the file out to run the defaults")
    if not isinstance(data, dict):
        raise DraftsmithError(f"config file {p} must hold a mapping at the top level")
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-friendly dict of a config (Paths as strings)."""
    def conv(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return {k: conv(v) for k, v in dataclasses.asdict(cfg).items()}


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argparse option per (non-nested) field of ``cls``."""
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            continue  # nested sections come from the config file
        meta = f.metadata
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        help_text = meta.get("help", "")
        if required:
            help_text += " (required)"
        elif default not in (None, False, [], ()):
            help_text += f" (default: {default})"
        # argparse %-formats help texts: a literal "70% of" must reach it as "70%% of"
        kw: dict[str, Any] = {"help": help_text.replace("%", "%%"), "default": argparse.SUPPRESS}
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if get_origin(tp) is Literal:
            kw["choices"] = list(get_args(tp))
        if meta.get("positional"):
            parser.add_argument(f.name, nargs=None if required else "?", **kw)
            continue
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif get_origin(tp) in (list, tuple):
            # "extend": both `--flag a b` and `--flag a --flag b` collect every value
            kw["nargs"] = "+"
            kw["action"] = "extend"
        parser.add_argument(flag_name(f.name), dest=f.name, **kw)


def to_argv(cfg: Any) -> list[str]:
    """The flags that rebuild ``cfg`` through :func:`add_arguments` (the inverse of parsing).

    Required fields and fields that differ from their defaults are written; nested
    sections are not (they come from config files).

    Raises:
        DraftsmithError: a value no flag can express (None or an empty list over a default).
    """
    hints = _field_types(type(cfg))
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        tp, _ = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            continue
        value = getattr(cfg, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if default is not dataclasses.MISSING and value == default:
            continue
        flag = flag_name(f.name)
        if value is None or (get_origin(tp) in (list, tuple) and not value):
            raise DraftsmithError(f"{flag}: {value!r} cannot be written as a command-line flag")
        if f.metadata.get("positional"):
            argv.append(str(value))
        elif tp is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif get_origin(tp) in (list, tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def from_args(cls: type, ns: argparse.Namespace, base: dict[str, Any] | None = None) -> Any:
    """Config from parsed args layered over ``base`` (e.g. a YAML file)."""
    data = dict(base or {})
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):
            data[f.name] = getattr(ns, f.name)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise DraftsmithError("missing required option(s): " + ", ".join(
            f.name if f.metadata.get("positional") else flag_name(f.name) for f in dataclasses.fields(cls)
            if f.name in missing))
    return from_dict(cls, data)
