"""Options declared once: each field of an options dataclass carries its help, its command-line flag and its
run-config key, so that the CLI (:mod:`glmc.cli.options`), the FL run config (``federation.settings``) and the docs
generated from both read one declaration. Torch-free, so that ``glmc --help`` builds its parser without loading
torch."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from glmc.errors import ConfigError

HELP, FLAG, KEY, NONE, SWITCH = "help", "flag", "key", "none", "switch"
UNSET: Any = object()  # no run-config stand-in for None, no switch
_UNION = type(int | None)


def option(default: Any, help: str, *, flag: str | None = "", key: str | None = None, none: Any = UNSET,
           switch: Any = UNSET) -> Any:
    """A dataclass field of default ``default`` and its ``help``. ``flag``: its command-line flag ("": ``--`` and the
    field's name in kebab case; None: none); ``key``: its run-config key (None: not in the run config); ``none``: the
    run-config value that stands for None (e.g. 0 or "auto"); ``switch``: the key is a boolean, true giving this value
    and false the default."""
    return dataclasses.field(default=default, metadata={HELP: help, FLAG: flag, KEY: key, NONE: none, SWITCH: switch})


@dataclass(frozen=True)
class Declared:
    """One declared option: its field, flag, run-config key, help, default and type (annotations resolved)."""

    name: str
    flag: str | None
    key: str | None
    help: str
    default: Any
    kind: Any
    none: Any = UNSET
    switch: Any = UNSET

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values a Literal option takes (None for an open one)."""
        return literal_choices(self.kind)

    @property
    def base(self) -> Any:
        """The type a value is parsed as: the annotation without ``| None``."""
        return without_none(self.kind)

    @property
    def key_kind(self) -> Any:
        """The type its run-config key takes: bool for a switch, else the field's without ``| None``."""
        return bool if self.switch is not UNSET else self.base

    def parse(self, value: Any) -> Any:
        """A run-config value of this option's key as the field's value; a wrong one is a one-line ConfigError."""
        assert self.key is not None
        if self.switch is not UNSET:
            return self.switch if coerce(self.key, bool, value) else self.default
        if self.none is not UNSET and value == self.none:
            return None
        return coerce(self.key, self.base, value)

    def unparse(self, value: Any) -> Any:
        """The field's value as its run-config key holds it (the inverse of :meth:`parse`)."""
        if self.switch is not UNSET:
            return value != self.default
        return self.none if value is None and self.none is not UNSET else value


def literal_choices(kind: Any) -> tuple[Any, ...] | None:
    """The values of the Literal in ``kind`` (alone or in a union), else None."""
    literal = next((a for a in (kind, *get_args(kind)) if get_origin(a) is Literal), None)
    return get_args(literal) if literal is not None else None


def without_none(kind: Any) -> Any:
    """``kind`` without ``| None``."""
    args = [a for a in get_args(kind) if a is not type(None)]
    return args[0] if get_origin(kind) in (typing.Union, _UNION) and len(args) == 1 else kind


def declared(cls: type) -> list[Declared]:
    """The options of dataclass ``cls`` that declare help (see :func:`option`), in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if HELP not in f.metadata:
            continue
        flag = f.metadata[FLAG]
        flag = "--" + f.name.replace("_", "-") if flag == "" else flag
        out.append(Declared(f.name, flag, f.metadata[KEY], f.metadata[HELP], f.default, hints[f.name],
                            f.metadata[NONE], f.metadata[SWITCH]))
    return out


def keyed(cls: type) -> dict[str, Declared]:
    """The options of ``cls`` that have a run-config key, by key."""
    return {d.key: d for d in declared(cls) if d.key is not None}


def from_keys(cls: type, config: Mapping[str, Any]) -> Any:
    """An instance of options dataclass ``cls`` from the run-config keys it declares (other keys ignored, the
    defaults for those not given); the class validates the whole, and its one-line error is prefixed with the keys
    given other values than their defaults."""
    given = {key: d for key, d in keyed(cls).items() if key in config}
    values = {d.name: d.parse(config[key]) for key, d in given.items()}
    try:
        return cls(**values)
    except ConfigError as err:
        changed = [f"{key}={config[key]!r}" for key, d in given.items() if values[d.name] != d.default]
        raise ConfigError(f"run-config {', '.join(changed)}: {err}" if changed else str(err)) from None


def to_keys(options: Any) -> dict[str, Any]:
    """The run-config keys of ``options`` (an instance of a declaring class), as :func:`from_keys` reads them."""
    return {key: d.unparse(getattr(options, d.name)) for key, d in keyed(type(options)).items()}


def coerce(key: str, kind: Any, value: Any) -> Any:
    """One run-config value as type ``kind`` (bool, int, float, str, a Literal, or tuple[float, ...] given as
    "1,0.5"), else a one-line ConfigError naming ``key`` and what it takes."""
    choices = literal_choices(kind)
    if choices is not None:
        if value in choices:
            return value
        raise ConfigError(f"run-config key {key!r} must be one of {', '.join(map(str, choices))}; got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind is str and isinstance(value, str):
        return value
    elif kind == tuple[float, ...]:
        return parse_floats(key, value)
    raise ConfigError(f"run-config key {key!r} must be {kind_name(kind)}, got {value!r}")


def kind_name(kind: Any) -> str:
    """A type as the run config's docs and errors name it: ``int``, ``float``, ``bool``, ``str``..."""
    if literal_choices(kind) is not None:
        return "str"
    return kind.__name__ if isinstance(kind, type) else str(kind)


def parse_floats(key: str, value: Any) -> tuple[float, ...]:
    """"1,0.5,0.25" (or one number) → (1.0, 0.5, 0.25); else a one-line ConfigError naming ``key``."""
    items = str(value).split(",") if isinstance(value, str) else [value]
    try:
        return tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be comma-separated numbers, got {value!r}") from None


def check_choices(options: Any, what: str) -> None:
    """A one-line ConfigError for the first field of dataclass ``options`` typed by a Literal whose value is not one
    of its choices (None passes where the type admits it)."""
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        choices, value = literal_choices(hints[f.name]), getattr(options, f.name)
        if choices is None or value in choices or (value is None and without_none(hints[f.name]) != hints[f.name]):
            continue
        raise ConfigError(f"unknown {what} {f.name} {value!r}; known: {', '.join(map(str, choices))}")
