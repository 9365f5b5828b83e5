"""The opcua handler with a DNS server that never answers (issue 42.2).

The handler runs in a subprocess in a mount namespace of its own (``unshare -m``) whose
``/etc/resolv.conf`` names a UDP port on loopback that this test binds and never reads (with
``timeout:30 attempts:5``: each lookup of a name not in ``/etc/hosts`` blocks its thread for
minutes), and whose ``/etc/hosts`` names one good server. A discovery server on loopback lists
a server by address, one by that name, and ten whose names go to the silent DNS server. The
probe reports what happened; the test checks:

- the loop's default executor (which the agent shares: store reads and writes, Allocate,
  the slice publisher) is not held by stuck lookups: every one of its workers can still run
  a job (before: they were all stuck in ``getaddrinfo``);
- the servers that resolve are offered under their own URLs in the first list (before: the
  named one was queued behind the stuck lookups, timed out and was offered under the
  discovery server's host — another device id);
- a name that gave no answer is not asked again before the next recheck: one lookup per hung
  name over several rechecks (before: one more at every answer of the discovery server).

Needs root (``unshare -m`` and a bind mount); skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO

HUNG = [f"plc-{index}.hung.example" for index in range(10)]
GOOD_NAME = "plc-good.hosts.example"
DEADLINE = 120.0  # generous: a loaded CI machine; never a timed assertion


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (unshare -m and bind mounts of /etc/resolv.conf and /etc/hosts)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def test_a_dns_server_that_never_answers_costs_nothing_else(tmp_path: Path) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never read
    address = f"127.0.{os.getpid() % 200 + 20}.53"
    silent.bind((address, 53))
    try:
        (tmp_path / "resolv.conf").write_text(
            f"nameserver {address}\noptions timeout:30 attempts:5\n"
        )
        (tmp_path / "hosts").write_text(f"127.0.0.1 localhost {GOOD_NAME}\n")
        script = (
            f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && "
            f"mount --bind {tmp_path / 'hosts'} /etc/hosts && "
            f"exec {sys.executable} -m tests.handlers.test_opcua_dns"
        )
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            cwd=REPO, capture_output=True, text=True, timeout=DEADLINE * 2,
        )  # fmt: skip
    finally:
        silent.close()
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["default_executor_free"], report
    assert sorted(report["first_list"]) == sorted([report["by_address"], report["by_name"]])
    assert report["lds_answers"] >= 4
    assert report["lookups_per_hung_name"] == [1] * len(HUNG), report


# -- the probe (run in the mount namespace) ------------------------------------------------------


async def _probe() -> dict[str, Any]:
    from discovery_handlers.opcua import OpcuaHandler
    from tests.doubles.opcua_servers import answer_find_servers

    lookups: collections.Counter[str] = collections.Counter()
    real = socket.getaddrinfo

    def counting(host: Any, *args: Any, **kwargs: Any) -> Any:
        lookups[str(host)] += 1
        return real(host, *args, **kwargs)

    socket.getaddrinfo = counting  # type: ignore[assignment]
    answers = [0]
    rechecked = asyncio.Event()
    listing: list[dict[str, Any]] = []

    async def lds(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers[0] += 1
        if answers[0] >= 4:  # several rechecks of the discovery server
            rechecked.set()
        await answer_find_servers(listing, reader, writer)

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_find_servers([], reader, writer)

    lds_server = await asyncio.start_server(lds, "127.0.0.1", 0)
    good = await asyncio.start_server(plain, "127.0.0.1", 0)
    lds_url = f"opc.tcp://127.0.0.1:{lds_server.sockets[0].getsockname()[1]}/"
    port = good.sockets[0].getsockname()[1]
    by_address, by_name = f"opc.tcp://127.0.0.1:{port}/", f"opc.tcp://{GOOD_NAME}:{port}/"
    listing += [
        {"name": "LDS", "url": lds_url, "type": 3},
        *({"name": f"Hung {i}", "url": f"opc.tcp://{host}:4840/"} for i, host in enumerate(HUNG)),
        {"name": "By address", "url": by_address},
        {"name": "By name", "url": by_name},
    ]
    details = (
        f"opcuaDiscoveryMethod: {{standard: {{discoveryUrls: ['{lds_url}']}}}}\n"
        "recheckIntervalSeconds: 1\nretryIntervalSeconds: 0.2\ntimeoutSeconds: 0.5\n"
    )
    lists: list[list[str]] = []
    got_first = asyncio.Event()

    async def consume() -> None:
        async for devices in OpcuaHandler().discover(details, {}):
            lists.append([device.id for device in devices])
            got_first.set()

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(DEADLINE):
        await got_first.wait()
        await rechecked.wait()
    # every worker of the loop's default executor must be able to run a job at once
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor()  # the default executor's size
    workers = executor._max_workers
    executor.shutdown()
    barrier = threading.Barrier(workers)
    jobs = [loop.run_in_executor(None, barrier.wait, DEADLINE / 4) for _ in range(workers)]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    free = not any(isinstance(result, BaseException) for result in results)
    consumer.cancel()
    return {
        "first_list": lists[0],
        "by_address": by_address,
        "by_name": by_name,
        "lds_answers": answers[0],
        "default_executor_free": free,
        "lookups_per_hung_name": [lookups[host] for host in HUNG],
    }


def main() -> None:
    asyncio.run(_probe_and_stop())


async def _probe_and_stop() -> None:
    print(json.dumps(await _probe()), flush=True)
    # threads stuck in getaddrinfo (before the fix: the default executor's) must not hold
    # the exit for minutes
    os._exit(0)


if __name__ == "__main__":
    main()
