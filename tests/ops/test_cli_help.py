"""Issue 34.12: ``--help`` shows every default, and every usage error is one line in one style.

A usage error names the command and the flag, says what is allowed and, when the input is
close to something that exists, what was probably meant. It never prints the usage block (the
old argparse behaviour for bad numbers and unknown flags: 30 lines for one typo).
"""

from __future__ import annotations

import argparse
import subprocess

import pytest

from agent.cli import _parser, main
from tests.harness.agent_process import akri_command, clean_env

COMMANDS = ["agent", "controller", "handler", "status"]


def help_of(command: str | None) -> str:
    parser = _parser(command)
    return (parser.subparser(command) if command else parser).format_help()


def actions_of(command: str) -> list[argparse.Action]:
    parser = _parser(command).subparser(command)
    return [
        action
        for action in parser._actions
        if action.option_strings
        and action.nargs != 0  # store_true, --help, --version: nothing to default
        and not isinstance(action, argparse.BooleanOptionalAction | argparse._HelpAction)
    ] + [a for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_s_help_shows_its_default(command: str) -> None:
    """Before: the graces, reclaim settings, log level, the controller's Lease timings and
    node grace said nothing of their defaults."""
    missing = [
        action.option_strings[0]
        for action in actions_of(command)
        if "default" not in (action.help or "")
    ]
    assert missing == [], f"akri {command} --help: no default shown for {missing}"


def test_the_defaults_shown_are_the_real_ones() -> None:
    agent = help_of("agent")
    for text in ("(default: 300)", "(default: 0)", "(default: INFO)", "(default: 3)"):
        assert text in " ".join(agent.split()), text
    controller = " ".join(help_of("controller").split())
    for text in ("(default: 15)", "(default: 300)", "(default: akri-controller)"):
        assert text in controller, text


def test_the_help_texts_read_as_text() -> None:
    top = help_of(None)
    assert "``" not in top  # the module docstring's reST markup is not help text
    assert "akri agent --local" in top  # where to start
    agent = _parser("agent").subparser("agent")
    assert agent.description and "--local" in agent.description
    status = {a.dest: a for a in _parser("status").subparser("status")._actions}
    assert status["output"].help and "json" in status["output"].help
    handler = {a.dest: a for a in _parser("handler").subparser("handler")._actions}
    poll = handler["poll_interval"].help or ""
    assert "Configuration" not in poll and "availability" in poll  # a handler's terms


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        akri_command(*args), capture_output=True, text=True, env=clean_env(), timeout=30
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["agent", "--local", "--confg", "x.yaml"],
            "akri agent: unknown flag --confg; did you mean '--config'?",
        ),
        (["agnet"], "akri: unknown command 'agnet'; did you mean 'agent'?"),
        (["agent", "--reclaim-grace", "abc"], "akri agent: --reclaim-grace: must be a number"),
        (["agent", "--log-level", "INFOO"], "akri agent: --log-level: must be DEBUG, INFO"),
        (["status", "-o", "yaml"], "akri status: -o (--output): must be table or json, got 'yaml'"),
        (["status", "--output=yaml"], "akri status: --output: must be table or json, got 'yaml'"),
        # issue 39.5: the flag as typed, not the first name of its pair
        (["agent", "--no-dra=1"], "akri agent: --no-dra: takes no value, got '1' (--dra turns"),
        (["agent", "--local", "--dra=yes"], "akri agent: --dra: takes no value, got 'yes'"),
        (
            ["controller", "--lease-duraton", "5"],
            "akri controller: unknown flag --lease-duraton; did you mean '--lease-duration'?",
        ),
        (["agent", "--state-dir"], "akri agent: --state-dir: needs a value"),
        ([], "akri: which command? one of version, agent"),
    ],
)
def test_usage_errors_are_one_line(argv: list[str], expected: str) -> None:
    done = run(*argv)
    assert done.returncode == 2, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr


def test_a_close_value_of_a_choice_is_suggested() -> None:
    assert "did you mean 'INFO'?" in run("agent", "--log-level", "INFOO").stderr
    assert (
        "did you mean 'device-plugins'?"
        in run("agent", "--extended-resources", "device-plugin").stderr
    )


def test_an_environment_value_is_checked_like_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AKRI_LOG_LEVEL", "loud")
    assert main(["agent", "--local"]) == 2
    assert capsys.readouterr().err == (
        "akri agent: environment variable AKRI_LOG_LEVEL (--log-level): must be DEBUG, INFO, "
        "WARNING or ERROR, got 'loud'\n"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["status", "--state", "x"],
            "akri status: unknown flag --state; did you mean '--state-dir'?",
        ),
        (["status", "--out", "json"], "akri status: unknown flag --out; did you mean '--output'?"),
        (["agent", "--local", "--conf", "x.yaml"], "akri agent: unknown flag --conf"),
        (["agent", "--local", "--state", "x"], "akri agent: unknown flag --state"),
        (["controller", "--lease-dur", "5"], "akri controller: unknown flag --lease-dur"),
        (["handler", "debugEcho", "--po", "9"], "akri handler: unknown flag --po"),
    ],
)
def test_a_flag_is_never_taken_by_its_prefix(argv: list[str], expected: str) -> None:
    """Issue 39.5: argparse took ``--state`` for ``--state-dir``: a script's abbreviation
    changes meaning, or breaks, the day a flag with the same start is added."""
    done = run(*argv)
    assert done.returncode == 2, done
    assert done.stderr.startswith(expected), done.stderr


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_parser_refuses_prefixes(command: str | None) -> None:
    parser = _parser(command)
    chosen = parser.subparser(command) if command else parser
    assert chosen.allow_abbrev is False
    if command:
        assert chosen is not parser  # the sub-command's own parser, not the top one
