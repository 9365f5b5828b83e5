"""``python -m tests.doubles.apiserver --port 8080 --crd crds/*.yaml [--kubeconfig PATH]``

Starts the API-server double, prints its URL on stdout once it accepts connections, and
serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from tests.doubles.apiserver.server import ApiServerDouble


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.doubles.apiserver", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--crd", nargs="*", default=[], help="CRD YAML files to preload")
    parser.add_argument("--kubeconfig", help="also write a kubeconfig for the server here")
    parser.add_argument("--history-size", type=int, default=1000)
    parser.add_argument("--bookmark-interval", type=float, default=5.0)
    return parser


async def _serve(args: argparse.Namespace) -> None:
    api = ApiServerDouble(
        host=args.host,
        port=args.port,
        crds=args.crd,
        history_size=args.history_size,
        bookmark_interval=args.bookmark_interval,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with api:
        if args.kubeconfig:
            api.write_kubeconfig(args.kubeconfig)
        print(api.url, flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    asyncio.run(_serve(_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
