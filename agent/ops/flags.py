"""Flags with a matching ``AKRI_*`` environment variable, as every ``akri`` process takes them.

A flag given on the command line wins over the environment; the environment wins over the
default (:func:`resolve`). The parsers say in their message what is allowed. Used by
``akri agent`` (``agent/node/settings.py``) and ``akri controller``
(``agent/controller/settings.py``), which each list their own :class:`Option` values.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from agent.core.bounded_yaml import did_you_mean

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}
MIN_INTERVAL = 0.05  # seconds: a shorter poll or pass interval only burns CPU


class SettingsError(ValueError):
    """A flag or environment variable has an unusable value."""


class ValueProblem(argparse.ArgumentTypeError, ValueError):
    """A flag or variable value that is not allowed; the message says what is."""


def one_of(*allowed: str, normalize: Callable[[str], str] = str.lower) -> Callable[[str], str]:
    """A parser that accepts one of ``allowed`` (after ``normalize``), and otherwise says
    which are allowed and the closest one. Its ``choices`` attribute names them for help."""

    def parse(text: str) -> str:
        value = normalize(text.strip())
        if value in allowed:
            return value
        listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise ValueProblem(f"must be {listed}, got {text[:40]!r}{did_you_mean(value, allowed)}")

    parse.choices = allowed  # type: ignore[attr-defined]
    return parse


parse_log_level = one_of("DEBUG", "INFO", "WARNING", "ERROR", normalize=str.upper)


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
    metavar: str | None = None  # default: from the parser (SECONDS, PORT, DIR, PATH, a choice)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def shown_default(self) -> str | None:
        """The default as ``--help`` shows it (None: the help text says it, in words)."""
        value = self.default
        if value is None or "default" in self.help:
            return None
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, (list, tuple)) and not value:
            return "none"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    def shown_metavar(self) -> str:
        if self.metavar:
            return self.metavar
        choices = getattr(self.parse, "choices", None)
        if choices:
            return "|".join(choices)
        if self.parse in (parse_seconds, parse_interval):
            return "SECONDS"
        if self.parse is parse_port:
            return "PORT"
        if self.parse is Path:
            return "DIR" if self.flag.endswith("-dir") else "PATH"
        return self.dest.upper()


class FlagParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line — the command, the flag as the user typed it,
    what is wrong and what would be right (with a "did you mean") — instead of the whole usage
    and a line at its end. Sub-commands' parsers are of this class too.

    A flag is taken only as written, never by a prefix (``allow_abbrev`` off, here and in every
    sub-command's parser, which ``add_subparsers`` makes of this class): with prefixes on,
    ``akri status --state X`` silently meant ``--state-dir X``, and a script's abbreviation
    would change meaning (or break) the day a flag with the same start is added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._words: list[str] = []  # the arguments this parser was given, for its errors

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {self.explain(message)}\n")

    def typed(self, names: str) -> str:
        """Which of an argument's ``names`` (``--dra/--no-dra``, ``--output/-o``, as argparse
        names it) the user typed: ``--no-dra``; a short one with its long name, ``-o
        (--output)``. The first name when none was typed as such."""
        options = names.split("/")
        for word in self._words:
            for option in options:
                if word == option or (option.startswith("--") and word.startswith(option + "=")):
                    if option.startswith("--") or option == options[0]:
                        return option
                    longs = [o for o in options if o.startswith("--")]
                    return f"{option} ({longs[0]})" if longs else option
        return options[0]

    def subparser(self, command: str) -> FlagParser:
        """The parser of ``command`` (this one if it has no such sub-command)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                found = action.choices[command]
                return found if isinstance(found, FlagParser) else self
        return self

    def flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def commands(self) -> list[str]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return list(action.choices)
        return []

    def explain(self, message: str) -> str:
        """argparse's message, said the way every other flag error is."""
        invalid = re.fullmatch(
            r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)", message
        )
        if invalid:
            what, value, allowed = invalid.groups()
            choices = re.findall(r"'([^']*)'", allowed)
            if what in ("command", "COMMAND"):
                return (
                    f"unknown command {value!r}{did_you_mean(value, choices)} "
                    f"(commands: {', '.join(choices)})"
                )
            flag = self.typed(what)
            hint = did_you_mean(value, choices)
            return f"{flag}: must be {' or '.join(choices)}, got {value!r}{hint}"
        required = re.fullmatch(r"the following arguments are required: (.*)", message)
        if required:
            missing = required.group(1)
            if missing in ("command", "COMMAND"):
                return f"which command? one of {', '.join(self.commands())} ({self.prog} --help)"
            return f"{missing} is missing ({self.prog} --help)"
        unrecognized = re.fullmatch(r"unrecognized arguments: (.*)", message)
        if unrecognized:
            return self.unknown(unrecognized.group(1).split())
        one_value = re.fullmatch(r"argument (\S+): expected one argument", message)
        if one_value:
            return f"{self.typed(one_value.group(1))}: needs a value"
        no_value = re.fullmatch(r"argument (\S+): ignored explicit argument '(.*)'", message, re.S)
        if no_value:
            names, value = no_value.groups()
            return f"{self.typed(names)}: takes no value, got {value[:40]!r}{switch_hint(names)}"
        argument = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
        if argument:
            return f"{self.typed(argument.group(1))}: {argument.group(2)}"
        return message

    def unknown(self, words: list[str]) -> str:
        """What to say about arguments nobody took."""
        flag = next((w for w in words if w.startswith("-")), None)
        if flag is not None:
            name = flag.split("=", 1)[0]
            return (
                f"unknown flag {name}{did_you_mean(name, self.flags())} "
                f"({self.prog} --help lists them)"
            )
        return f"unexpected argument {words[0]!r} ({self.prog} --help)"


def switch_hint(names: str) -> str:
    """`` (--dra turns it on, --no-dra off)`` for an on/off flag's ``--dra/--no-dra``."""
    options = names.split("/")
    on = next((o for o in options if o.startswith("--") and not o.startswith("--no-")), None)
    if on is not None and f"--no-{on[2:]}" in options:
        return f" ({on} turns it on, --no-{on[2:]} off)"
    return ""


def add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """Add ``options`` to ``parser`` with defaults left unset (resolved by :func:`resolve`)."""
    for option in options:
        shown = option.shown_default()
        default = f" (default: {shown})" if shown is not None else ""
        help_text = f"{option.help}{default} [env {option.env}]"
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
                option.flag,
                dest=option.dest,
                default=None,
                type=option.parse,
                metavar=option.shown_metavar(),
                help=help_text,
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
