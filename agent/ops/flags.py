"""Flags with a matching ``AKRI_*`` environment variable, as every ``akri`` process takes them.

A flag given on the command line wins over the environment; the environment wins over the
default (:func:`resolve`). The parsers say in their message what is allowed. Used by
``akri agent`` (``agent/node/settings.py``) and ``akri controller``
(``agent/controller/settings.py``), which each list their own :class:`Option` values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}
MIN_INTERVAL = 0.05  # seconds: a shorter poll or pass interval only burns CPU


class SettingsError(ValueError):
    """A flag or environment variable has an unusable value."""


class ValueProblem(argparse.ArgumentTypeError, ValueError):
    """A flag or variable value that is not allowed; the message says what is."""


def parse_bool(text: str) -> bool:
    """Parse a boolean environment value."""
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueProblem(f"must be true or false, got {text[:40]!r}")


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueProblem(f"must be a number of seconds, got {text[:40]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueProblem(f"must be a finite number of seconds, got {text[:40]!r}")
    return value


def parse_seconds(text: str) -> float:
    """Parse a non-negative number of seconds."""
    value = _number(text)
    if value < 0:
        raise ValueProblem(f"must be ≥ 0, got {text[:40]}")
    return value


def parse_interval(text: str) -> float:
    """Parse an interval in seconds, at least :data:`MIN_INTERVAL`."""
    value = _number(text)
    if value < MIN_INTERVAL:
        raise ValueProblem(f"must be ≥ {MIN_INTERVAL} seconds, got {text[:40]}")
    return value


def parse_port(text: str) -> int:
    """Parse a TCP port, 0 meaning off."""
    try:
        value = int(text)
    except ValueError:
        raise ValueProblem(f"must be a port number, got {text[:40]!r}") from None
    if not 0 <= value < 65536:
        raise ValueProblem(f"must be 0 (off) to 65535, got {value}")
    return value


@dataclass(frozen=True)
class Option:
    """One setting: flag, env var (+ fallbacks, e.g. Akri's names), parser and default.
    ``repeat``: the flag may be given more than once (its values are a list of ``Path``)."""

    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    fallbacks: tuple[str, ...] = ()
    repeat: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """Add ``options`` to ``parser`` with defaults left unset (resolved by :func:`resolve`)."""
    for option in options:
        help_text = f"{option.help} [env {option.env}]"
        if option.parse is parse_bool:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        elif option.repeat:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                default=None,
                action="append",
                type=Path,
                metavar="PATH",
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag, dest=option.dest, default=None, type=option.parse, help=help_text
            )


def resolve(
    args: argparse.Namespace, options: tuple[Option, ...], environ: Mapping[str, str]
) -> dict[str, Any]:
    """Flag, else environment, else default, for every option."""
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(args, option.dest, None)
        if value is None:
            for name in (option.env, *option.fallbacks):
                if name in environ:
                    try:
                        value = option.parse(environ[name])
                    except (ValueError, TypeError) as error:
                        raise SettingsError(
                            f"environment variable {name} ({option.flag}): {error}"
                        ) from error
                    break
        values[option.dest] = option.default if value is None else value
    return values
