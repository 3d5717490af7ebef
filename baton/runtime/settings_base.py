"""How a setting is declared (`setting()`) and how its flag reads and shows a value: the
machinery under baton/runtime/settings.py, which declares the settings themselves and
alone reads the environment.

A value is read the same way from a flag and from its BATON_* variable (`parser_of`):
by the field's type, or as one of its `choices`, or as a size whose bare number means
what the setting says. --help shows the choices (as the metavar), what a bare size
means, the default and the variable (`flag_help`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any

from baton.runtime.values import is_bare_size, parse_bool, parse_choice, parse_list, parse_size

ENV_PREFIX = "BATON_"
# A module logger, not logging.warning: that would configure the root logger before
# configure_logging runs (settings are read first), and the --log-level given would be lost.
logger = logging.getLogger(__name__)


class SettingsError(ValueError):
    """A flag or environment value that does not parse, or settings that do not fit."""


def setting(default: Any = dataclasses.MISSING, help: str = "", *, parse: Callable[[str], Any] | None = None,
            shown: str | None = None, default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
            secret: bool = False, choices: tuple[str, ...] | None = None, size: str | None = None) -> Any:
    """A dataclass field that is also a flag and an environment variable.

    `parse` turns the text of a flag or variable into the value (default: by the
    field's type); `choices` are the only values it takes (parse_choice: case aside,
    'cuda:N' for any index); `size` makes it a size in bytes and names the unit a bare
    number is read in ('GiB', 'B'), which --help says and a warning repeats; `shown` is
    how --help writes a default that is not a literal; a `secret` is left out of the
    settings' repr (and so of logs).
    """
    metadata = {"help": help, "parse": parse, "shown": shown, "choices": choices, "size": size}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return field(default=default, metadata=metadata, repr=not secret)


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass field `name` (to derive a flag's default from a config's)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no plain default")
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------ reading a value
def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if "help" in f.metadata]


def base_type(hint: Any) -> Any:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def parser_of(f: dataclasses.Field, hint: Any) -> Callable[[str], Any]:
    """How the text of `f`'s flag or variable becomes its value (ValueError if it cannot)."""
    meta = f.metadata
    if meta["size"] is not None:
        return _size_parser(f.name, meta["size"])
    if meta["choices"] is not None:
        return lambda text: parse_choice(text, meta["choices"])
    if meta["parse"] is not None:
        return meta["parse"]
    base = base_type(hint)
    if base is bool:
        return parse_bool
    if typing.get_origin(base) is tuple:
        return parse_list
    if base is int:
        return lambda text: _number(int, text)
    if base is float:
        return lambda text: _number(float, text)
    return str


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None


_WARNED_BARE_SIZES: set[str] = set()  # the settings already warned about, once per process


def _size_parser(name: str, unit: str) -> Callable[[str], int]:
    """parse_size, a bare number counted in `unit`; a bare number other than 0 (which is
    0 in any unit) is warned about, since its meaning is this setting's own."""
    bare_unit = parse_size("1" + unit)

    def parse(text: str) -> int:
        size = parse_size(text, bare_unit)
        if size and is_bare_size(text) and name not in _WARNED_BARE_SIZES:
            _WARNED_BARE_SIZES.add(name)
            logger.warning("%s (%s) %s has no unit: read as %s%s; write the unit to say so", flag_name(name),
                           env_name(name), text.strip(), text.strip(), unit)
        return size

    return parse


# ------------------------------------------------------------------ showing it in --help
_UNIT_WORDS = {"B": "bytes"}


def flag_help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if (unit := f.metadata["size"]) is not None:
        bare = _UNIT_WORDS.get(unit, unit)
        text += f"; a size with a unit (512M, 4GiB, 1048576B): a bare number is read as {bare}"
    return f"{text} (default: {_shown(f)}; env {env_name(f.name)})"


def _shown(f: dataclasses.Field) -> str:
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    if f.default is dataclasses.MISSING or f.default is None:
        return "none"
    if isinstance(f.default, tuple):
        return ",".join(f.default) or "none"
    return str(f.default)


def metavar(f: dataclasses.Field, hint: Any) -> str:
    if f.metadata["size"] is not None:
        return "SIZE"
    if f.metadata["choices"] is not None:  # as argparse shows its own choices
        return "{" + ",".join(f.metadata["choices"]) + "}"
    base = base_type(hint)
    return {int: "N", float: "X"}.get(base, "LIST" if typing.get_origin(base) is tuple else "TEXT")


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse: its ValueError becomes argparse's one-line error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert
