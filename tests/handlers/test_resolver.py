"""``discovery_handlers.resolver``: host-name lookups on threads of their own (issue 42.1,
42.2), with a lookup function of the test's (one that hangs until released) and a clock of
its own."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from discovery_handlers.resolver import (
    BadHostName,
    LookupTimeout,
    NoSuchHost,
    Resolver,
    host_name_problem,
)


class Lookups:
    """A lookup function: answers 127.0.0.1 at once, raises for ``*.missing``, and blocks
    on ``release`` for ``*.hung`` (a DNS server that does not answer); counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    def __call__(self, host: str, port: int) -> list[tuple[int, str]]:
        self.calls.append(host)
        if host.endswith(".hung"):
            self.release.wait(60)
        if host.endswith(".missing"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, "127.0.0.1")]


@pytest.fixture
def lookups() -> Iterator[Lookups]:
    found = Lookups()
    yield found
    found.release.set()  # no thread stays blocked after the test


async def test_a_name_that_is_not_a_host_name_is_refused_before_anything_is_asked(
    lookups: Lookups,
) -> None:
    resolver = Resolver(lookup=lookups)
    for host in ("plc..local", "a" * 64 + ".example", ".plc"):
        assert host_name_problem(host) is not None
        with pytest.raises(BadHostName, match="is not a valid host name"):
            await resolver.lookup(host, seconds=1)
    assert lookups.calls == []
    assert await resolver.lookup("10.0.0.1", seconds=1) == [(socket.AF_INET, "10.0.0.1")]
    assert await resolver.lookup("fe80::1", seconds=1) == [(socket.AF_INET6, "fe80::1")]
    assert lookups.calls == []  # IP literals need no lookup
    with pytest.raises(NoSuchHost, match=r"'plc\.missing' does not resolve"):
        await resolver.lookup("plc.missing", seconds=1)


async def test_a_host_that_gave_no_answer_is_not_asked_again_before_quiet_is_over(
    lookups: Lookups,
) -> None:
    now = [0.0]
    resolver = Resolver(lookup=lookups, clock=lambda: now[0])
    with pytest.raises(LookupTimeout, match=r"did not resolve within 0\.05 s"):
        await resolver.lookup("plc.hung", seconds=0.05, quiet=10)
    # within the quiet time: an answer at once, nothing asked
    with pytest.raises(LookupTimeout, match="when last asked"):
        await resolver.lookup("plc.hung", seconds=5, quiet=10)
    assert lookups.calls == ["plc.hung"]
    # other names go on meanwhile, on other threads
    assert await resolver.lookup("plc.good", seconds=5) == [(socket.AF_INET, "127.0.0.1")]
    now[0] = 11.0  # the next recheck: asked again — the stuck lookup is shared, not repeated
    with pytest.raises(LookupTimeout):
        await resolver.lookup("plc.hung", seconds=0.05, quiet=10)
    assert lookups.calls == ["plc.hung", "plc.good"]
    assert resolver.in_flight() == 1
    lookups.release.set()  # the DNS server answers at last
    now[0] = 22.0
    assert await resolver.lookup("plc.hung", seconds=5) == [(socket.AF_INET, "127.0.0.1")]


async def test_lookups_are_bounded_and_never_use_the_default_executor(lookups: Lookups) -> None:
    resolver = Resolver(threads=2, max_queued=1, lookup=lookups)
    hung = [asyncio.create_task(resolver.lookup(f"{i}.hung", seconds=30)) for i in range(2)]
    async with asyncio.timeout(30):
        while resolver.in_flight() < 2 or len(lookups.calls) < 2:  # both threads held
            assert not any(task.done() for task in hung)
            await asyncio.sleep(0.01)
    queued = asyncio.create_task(resolver.lookup("queued.example", seconds=30))
    await asyncio.sleep(0.05)
    with pytest.raises(LookupTimeout, match="waits behind too many host names"):
        await resolver.lookup("one-too-many.example", seconds=30)
    # the loop's default executor is free meanwhile
    assert await asyncio.to_thread(lambda: "free") == "free"
    names = {thread.name for thread in threading.enumerate()}
    assert "akri-resolver" in names
    lookups.release.set()
    await asyncio.gather(*hung, queued)


async def test_a_name_asked_after_names_that_hang_gets_a_thread_of_its_own() -> None:
    """Ten names that hang, then one that answers, in one burst (a discovery server's
    list): the last one must not be left in the queue while every thread is stuck (before:
    a thread counted idle took an older job, and the last job had no thread, for ever)."""
    for _ in range(20):
        lookups = Lookups()
        resolver = Resolver(lookup=lookups)
        try:
            hung = [
                asyncio.create_task(resolver.lookup(f"{i}.hung", seconds=30)) for i in range(10)
            ]
            good = asyncio.create_task(resolver.lookup("plc.good", seconds=30))
            async with asyncio.timeout(20):
                assert await good == [(socket.AF_INET, "127.0.0.1")]
        finally:
            lookups.release.set()
        await asyncio.gather(*hung)
