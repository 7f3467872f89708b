"""The project's exceptions, in one place, so callers can catch one base and print one line."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

LINE_LIMIT = 200  # characters of a quoted exception message in a one-line error


class GlmcError(Exception):
    """Base of every error glmc raises on purpose; its message is one line naming the problem."""


class DataNotFoundError(GlmcError):
    """A dataset is missing locally; the message says how to get it."""


class ConfigError(GlmcError):
    """An unknown preset, a width that does not fit, or an inconsistent option."""


class CheckpointError(GlmcError):
    """A checkpoint that is corrupt, not safetensors, or does not match the requested model."""


class SpecError(GlmcError):
    """A state dict that a symmetry spec does not cover exactly once, or two models that differ."""


class NonFiniteError(GlmcError):
    """A model whose weights hold NaN or inf: no symmetry maps it to a finite one, and every solver would fail."""


class DeployError(GlmcError):
    """A SuperLink or SuperNode that would not start or join, or a flwr command that failed; quotes its log."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message that says something, for one-line errors: a header ending in ":"
    (torch's "Error(s) in loading state_dict for X:") gives way to the line after it; cut to LINE_LIMIT."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    line = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return line if len(line) <= LINE_LIMIT else f"{line[:LINE_LIMIT - 1]}…"


Rule = tuple[str, Callable[[float], bool], Mapping[str, float | None]]  # (what is allowed, test, name → value)


def check_options(what: str, rules: Iterable[Rule]) -> None:
    """ConfigError naming every option that breaks its rule, e.g. "learned matching: epochs=0 (must be ≥ 1)";
    options given as None are unset and pass."""
    bad = [f"{name}={value} (must be {allowed})" for allowed, test, values in rules
           for name, value in values.items() if value is not None and not test(value)]
    if bad:
        raise ConfigError(f"{what}: {'; '.join(bad)}")


def check_weights(weights: Iterable[float], n: int) -> list[float]:
    """``weights`` as floats, one per model and each finite and positive, else a one-line ConfigError."""
    floats = [float(w) for w in weights]
    if len(floats) != n or not all(math.isfinite(w) and w > 0 for w in floats):
        raise ConfigError(f"need one positive weight per model, got {floats} for {n} models")
    return floats
