"""How scripts/test.sh spreads the suite over processes (pytest-xdist, ``--dist loadgroup``):
each test file stays in one process, in order, as when run alone (module fixtures start once,
tests written to follow each other still do), and the files that use what a host has only
once — multicast on loopback (WS-Discovery 3702, mDNS 5353), network and mount namespaces,
umockdev's /sys, fixed OPC UA ports — run in one process, one after the other. Without xdist
these markers change nothing."""

from __future__ import annotations

import tempfile

import pytest

from tests.paths import REPO

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.relative_to(REPO).as_posix()
        group = "host-network" if path in HOST_NETWORK else path
        item.add_marker(pytest.mark.xdist_group(group))
