"""How scripts/test.sh spreads the suite over processes (pytest-xdist, ``-n 2``):
each test file stays in one process, in order, as when run alone (module fixtures start once,
tests written to follow each other still do), and the files that use what a host has only
once — multicast on loopback (WS-Discovery 3702, mDNS 5353), network and mount namespaces,
umockdev's /sys, node-opcua's servers — run in one process, one after the other
(:func:`pytest_xdist_make_scheduler`). Without xdist this changes nothing."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

HOST_NETWORK = frozenset(
    {
        "tests/handlers/test_mdns_discovery.py",
        "tests/handlers/test_onvif_discovery.py",
        "tests/handlers/test_onvif_netns.py",
        "tests/handlers/test_onvif_two_nodes.py",
        "tests/handlers/test_opcua_dns.py",
        "tests/handlers/test_opcua_interop.py",
        "tests/handlers/test_opcua_netns.py",
        "tests/handlers/test_udev_discovery.py",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """``pytest -n N`` without ``--basetemp`` (scripts/test.sh gives one): a short base, as
    xdist's ``popen-gwN/`` under pytest's default one would push the agents' unix socket
    paths past the 107 bytes Linux allows."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="akt.", dir="/tmp")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's own scheduling by file, with the files of :data:`HOST_NETWORK` as one unit.
    (Not ``xdist_group`` marks: xdist 3.8 renames a marked test's ``_nodeid``, which pytest 9.2
    no longer reads, so the marks group nothing.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByFile(config, log)


def scope_of(nodeid: str) -> str:
    """The unit a test is sent to a process with: its file, or ``host-network``."""
    path = nodeid.split("::", 1)[0]
    return "host-network" if path in HOST_NETWORK else path
