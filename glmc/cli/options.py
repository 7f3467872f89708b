"""The matchers' flags, read off their declarations (:mod:`glmc.match.options`, :func:`glmc.core.options.option`):
one flag per declared option of each section a method reads, and the :class:`~glmc.match.options.MatchOptions` the
given flags make. A new option declared there is a new flag here, with no code of its own."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, get_args

from glmc.core.options import Declared, declared
from glmc.errors import ConfigError
from glmc.match.options import ActivationOptions, LearnConfig, MatchOptions, SymmetryOptions, WeightOptions
from glmc.match.registry import OPTION_SECTIONS

if TYPE_CHECKING:
    from glmc.symmetry.canonical import Form

# Each section of MatchOptions: its class and how its flags' help begins.
SECTIONS: dict[str, tuple[type, str]] = {"symmetry": (SymmetryOptions, "every matcher but the permutation-only "
                                                                      "ones"),
                                         "weight": (WeightOptions, "weight matching"),
                                         "activation": (ActivationOptions, "activation matching"),
                                         "learn": (LearnConfig, "learned methods")}


def add_match_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None,
                        skip: Iterable[str] = (), sections: Iterable[str] = OPTION_SECTIONS) -> None:
    """A flag for every declared option of ``sections`` (default: every section a registered method reads;
    ``defaults``: a command's own defaults by field name; ``skip``: fields this command has no use for), and
    --quiet."""
    defaults, skip = defaults or {}, set(skip)
    for section in sections:
        for option in declared(SECTIONS[section][0]):
            if option.flag is not None and option.name not in skip:
                add_option_argument(parser, section, option.name, defaults.get(option.name))
    parser.add_argument("--quiet", action="store_true", help="no progress bar or info logs")


def add_option_argument(parser: argparse.ArgumentParser, section: str, name: str, default: Any = None) -> None:
    """The flag of one declared option, ``name`` of ``section`` (``default``: this command's own, else the
    section's)."""
    cls, what = SECTIONS[section]
    (option,) = [o for o in declared(cls) if o.name == name]
    assert option.flag is not None
    parser.add_argument(option.flag, **_argument(cls, option, what, default))


def _argument(cls: type, option: Declared, what: str, default: Any) -> dict[str, Any]:
    """add_argument's keywords for ``option`` of section ``cls``: its choices or type (a pair takes two values), and
    its help with the default; an option not given stays None, so the section's own default applies."""
    shown = option.default if default is None else default
    shown = " ".join(map(str, shown)) if isinstance(shown, tuple) else shown
    said = "" if shown is None else f" (default {shown})"  # None: the help says what happens
    keywords: dict[str, Any] = {"default": default, "help": f"{what}: {option.help}{said}"}
    if option.choices is not None:
        return keywords | {"choices": [c for c in option.choices if c is not None]}
    base = option.base
    if getattr(base, "__origin__", None) is tuple:
        kinds = get_args(base)
        return keywords | {"type": _checked(cls, option, kinds[0], len(kinds)), "nargs": len(kinds),
                           "metavar": ("LO", "HI")}
    return keywords | {"type": _checked(cls, option, base)}


def _checked(cls: type, option: Declared, kind: type, repeat: int = 0) -> Callable[[str], Any]:
    """An argparse type: the text as ``kind``, refused at once (naming its flag) unless section ``cls`` accepts it
    (``repeat``: the field is a tuple of that many, each value checked as all of them)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind.__name__}, got {text!r}") from None
        try:
            cls(**{option.name: (value,) * repeat if repeat else value})
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def section_from(args: argparse.Namespace, section: str, **given: Any) -> Any:
    """One section of MatchOptions from the flags given (the section's defaults for the rest) and ``given``."""
    cls, _ = SECTIONS[section]
    for option in declared(cls):
        value = getattr(args, _dest(option), None) if option.flag is not None else None
        if value is not None and option.name not in given:
            given[option.name] = tuple(value) if isinstance(value, list) else value
    return cls(**given)


def match_options(args: argparse.Namespace, form: Form = "standard", batch: int | None = None) -> MatchOptions:
    """The MatchOptions the flags give: every section, activation matching on ``batch`` samples (None: its
    default), the learned methods' progress bar unless --quiet."""
    activation = {"batch": batch} if batch is not None else {}
    return MatchOptions(form, section_from(args, "weight"), section_from(args, "activation", **activation),
                        section_from(args, "learn", progress=not getattr(args, "quiet", True)),
                        section_from(args, "symmetry"))


def parse_match_flags(flags: list[str]) -> MatchOptions:
    """The MatchOptions that a list of these flags names (a bench config's ``matcher``), for library calls."""
    parser = argparse.ArgumentParser(prog="matcher")
    add_match_arguments(parser)
    return match_options(parser.parse_args(flags))


def _dest(option: Declared) -> str:
    assert option.flag is not None
    return option.flag[2:].replace("-", "_")
