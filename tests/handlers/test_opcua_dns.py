"""The opcua handler (and mqtt's and onvif's) with a DNS server that never answers (issue 42.2).

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
import contextlib
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


def _run_probe(tmp_path: Path, handler: str) -> dict[str, Any]:
    """Run ``handler``'s probe in a mount namespace with a DNS server that never answers."""
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
            f"exec {sys.executable} -m tests.handlers.test_opcua_dns {handler}"
        )
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            cwd=REPO, capture_output=True, text=True, timeout=DEADLINE * 2,
        )  # fmt: skip
    finally:
        silent.close()
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_a_dns_server_that_never_answers_costs_nothing_else(tmp_path: Path) -> None:
    report = _run_probe(tmp_path, "opcua")
    assert report["discovery_error"] is None, report
    assert report["default_executor_free"], report
    # the first list waits for the names at most timeoutSeconds (2 s): the one in /etc/hosts
    # answers at once, on a thread of its own (the hung ones hold theirs)
    both = sorted([report["by_address"], report["by_name"]])
    assert sorted(report["first_list"]) == both, report
    assert sorted(report["last_list"]) == both, report
    assert report["lds_answers"] >= 4
    assert report["lookups_per_hung_name"] == [1] * len(HUNG), report


@pytest.mark.parametrize("handler", ["mqtt", "onvif"])
def test_the_other_handlers_resolve_on_their_own_threads_too(tmp_path: Path, handler: str) -> None:
    """mqtt (paho resolves the broker in the default executor) and onvif (aiohttp's default
    resolver uses it) with names the silent DNS server should answer: the default executor
    stays free (before: one stuck worker per broker connect and per camera call)."""
    report = _run_probe(tmp_path, handler)
    assert report["looked_up"] >= 1, report  # the names were really asked
    assert report["default_executor_free"], report


# -- the probe (run in the mount namespace) ------------------------------------------------------


async def _probe() -> dict[str, Any]:
    from discovery_handlers.opcua import OpcuaHandler
    from tests.doubles.opcua_servers import answer_find_servers

    lookups, _ = _counting_lookups()
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
        "recheckIntervalSeconds: 1\nretryIntervalSeconds: 0.2\ntimeoutSeconds: 2\n"
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
    free = await _default_executor_free()
    error = repr(consumer.exception()) if consumer.done() else None  # discovery died?
    consumer.cancel()
    return {
        "discovery_error": error,
        "first_list": lists[0],
        "last_list": lists[-1],
        "by_address": by_address,
        "by_name": by_name,
        "lds_answers": answers[0],
        "default_executor_free": free,
        "lookups_per_hung_name": [lookups[host] for host in HUNG],
    }


async def _default_executor_free() -> bool:
    """Can every worker of the loop's default executor run a job now (none is stuck)?"""
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor()  # the default executor's size
    workers = executor._max_workers
    executor.shutdown()
    barrier = threading.Barrier(workers)
    jobs = [loop.run_in_executor(None, barrier.wait, DEADLINE / 4) for _ in range(workers)]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    return not any(isinstance(result, BaseException) for result in results)


def _counting_lookups() -> tuple[collections.Counter[str], asyncio.Event]:
    """Count ``getaddrinfo`` calls per host (whatever thread makes them); the event is set at
    the first one."""
    lookups: collections.Counter[str] = collections.Counter()
    asked = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = socket.getaddrinfo

    def counting(host: Any, *args: Any, **kwargs: Any) -> Any:
        lookups[str(host)] += 1
        loop.call_soon_threadsafe(asked.set)
        return real(host, *args, **kwargs)

    socket.getaddrinfo = counting  # type: ignore[assignment]
    return lookups, asked


async def _probe_mqtt() -> dict[str, Any]:
    from discovery_handlers.mqtt.handler import MqttHandler

    lookups, asked = _counting_lookups()
    text = "broker: {host: broker.hung.example}\ntopics: ['a/#']\n"

    async def connect_again_and_again() -> None:
        while True:
            try:
                async for _ in MqttHandler().discover(text, {}):
                    pass
            except Exception:  # the broker does not resolve: the agent retries likewise
                await asyncio.sleep(0.1)

    task = asyncio.create_task(connect_again_and_again())
    async with asyncio.timeout(DEADLINE):
        await asyncio.sleep(1.0)  # several connects
        await asyncio.wait_for(asked.wait(), DEADLINE)
    free = await _default_executor_free()
    task.cancel()
    return {"looked_up": lookups["broker.hung.example"], "default_executor_free": free}


async def _probe_onvif() -> dict[str, Any]:
    from discovery_handlers.onvif.credentials import CredentialStore
    from discovery_handlers.onvif.device_query import CallFailed, DeviceQuerier, Refused

    lookups, _ = _counting_lookups()
    async with DeviceQuerier(CredentialStore(), timeout=0.5) as querier:
        for index in range(4):  # cameras whose XAddrs name hosts the DNS server should know
            url = f"http://cam-{index}.hung.example/onvif/device_service"
            with contextlib.suppress(CallFailed, Refused):
                await querier.call(url, "GetDeviceInformation", None)
    free = await _default_executor_free()
    looked_up = sum(lookups[f"cam-{index}.hung.example"] for index in range(4))
    return {"looked_up": looked_up, "default_executor_free": free}


def main() -> None:
    asyncio.run(_probe_and_stop(sys.argv[1]))


async def _probe_and_stop(handler: str) -> None:
    probes = {"opcua": _probe, "mqtt": _probe_mqtt, "onvif": _probe_onvif}
    print(json.dumps(await probes[handler]()), flush=True)
    # threads stuck in getaddrinfo (before the fix: the default executor's) must not hold
    # the exit for minutes
    os._exit(0)


if __name__ == "__main__":
    main()
