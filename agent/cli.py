"""The ``akri`` command: ``akri agent`` and ``akri status``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from agent.settings import AGENT_OPTIONS, AgentSettings, SettingsError, add_options, resolve
from agent.store.base import CorruptStateError, InstanceStore, StoreError

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CORRUPT_STATE = 3
EXIT_UNAVAILABLE = 4
EXIT_UNUSABLE_PATH = 5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="akri", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    agent = commands.add_parser("agent", help="run the node agent")
    add_options(agent, AGENT_OPTIONS)
    status = commands.add_parser("status", help="show Instances of a local state directory")
    status.add_argument(
        "--state-dir", type=Path, default=None, help="state directory [env AKRI_STATE_DIR]"
    )
    status.add_argument("--output", "-o", choices=("table", "json"), default="table")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _check_state_dir(path: Path) -> str | None:
    """Why ``path`` cannot hold the local state (None if it can): it is created if missing,
    and a file is written and removed to prove it is writable."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    return None


async def _run_agent(settings: AgentSettings) -> int:
    from agent.app import Agent
    from agent.store.local import LocalInstanceStore

    store: InstanceStore
    if settings.local:
        problem = _check_state_dir(settings.state_dir)
        if problem is not None:
            logging.getLogger("agent").error(
                "cannot use the state directory (--state-dir) %s", problem
            )
            return EXIT_UNUSABLE_PATH
        store = LocalInstanceStore(
            settings.state_dir, settings.config, poll_interval=settings.poll_interval
        )
    else:
        from agent.kube import make_kube_client
        from agent.store.kubernetes import KubernetesInstanceStore, KubernetesSettings

        try:
            api_client = make_kube_client(settings.kubeconfig)
        except Exception as error:
            logging.getLogger("agent").error(
                "cannot configure the Kubernetes client (%s: %s); use --kubeconfig, run "
                "in a pod, or use --local",
                type(error).__name__,
                error,
            )
            return EXIT_USAGE
        store = KubernetesInstanceStore(
            api_client,
            KubernetesSettings(settings.node_name, settings.namespace, settings.kubeconfig),
        )
    agent = Agent(settings, store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await agent.run(stop)
    except CorruptStateError as error:
        logging.getLogger("agent").error("refusing to start: %s", error)
        return EXIT_CORRUPT_STATE
    except StoreError as error:
        logging.getLogger("agent").error("cannot start: %s", error)
        return EXIT_UNAVAILABLE
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        logging.getLogger("agent").error("cannot start: %s%s", where, error.strerror or error)
        return EXIT_UNUSABLE_PATH
    return 0


def _status(args: argparse.Namespace) -> int:
    from agent.status import to_json, to_table
    from agent.store.local import read_state_dir

    state_dir = args.state_dir or Path(os.environ.get("AKRI_STATE_DIR", "/var/lib/akri/state"))
    if not state_dir.is_dir():
        what = "is not a directory" if state_dir.exists() else "does not exist"
        print(f"akri status: state directory {state_dir} {what}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        instances = read_state_dir(state_dir)
    except CorruptStateError as error:
        print(f"akri status: {error}", file=sys.stderr)
        return EXIT_CORRUPT_STATE
    try:
        print(to_json(instances) if args.output == "json" else to_table(instances))
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (``| head``): no traceback, and none at exit either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``akri`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args)
    try:
        settings = AgentSettings.from_values(resolve(args, AGENT_OPTIONS, os.environ))
    except SettingsError as error:
        print(f"akri agent: {error}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(settings.log_level)
    return asyncio.run(_run_agent(settings))


if __name__ == "__main__":
    sys.exit(main())
