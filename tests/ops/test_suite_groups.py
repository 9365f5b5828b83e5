"""tests/conftest.py keeps the test files that use a host's one-of-a-kind resources in one
xdist process: a file that starts using them must be listed, a listed file must exist."""

from __future__ import annotations

import re

from tests.conftest import HOST_NETWORK, scope_of
from tests.paths import REPO, TESTS

# what a test file does that another process doing it at the same time would disturb
HOST_WIDE = re.compile(
    r"\"netns\", \"(?:add|exec)\"|\"unshare\"|umockdev-wrapper|interfaces: \[lo\]|Zeroconf\(|"
    r"node_opcua"
)

# an unshare'd mount namespace of their own and nothing else host-wide: may run beside anything
PRIVATE_MOUNTS_ONLY = frozenset(
    {"tests/core/test_state_reads.py", "tests/deploy/test_repo_commands.py"}
)


def test_every_listed_file_exists() -> None:
    assert sorted(p for p in HOST_NETWORK if not (REPO / p).is_file()) == []


def test_every_file_using_host_wide_resources_is_listed() -> None:
    using = {
        path.relative_to(REPO).as_posix()
        for path in TESTS.rglob("test_*.py")
        if path.name != "test_suite_groups.py" and HOST_WIDE.search(path.read_text())
    }
    assert using, "the pattern finds nothing: it no longer matches how the tests do it"
    assert using >= PRIVATE_MOUNTS_ONLY
    assert sorted(using - HOST_NETWORK - PRIVATE_MOUNTS_ONLY) == []


def test_a_test_goes_with_its_file_or_with_the_host_network_files() -> None:
    assert scope_of("tests/handlers/test_mdns_discovery.py::test_a[x::y]") == "host-network"
    assert scope_of("tests/handlers/test_opcua_netns.py::test_b") == "host-network"
    assert scope_of("tests/core/test_layout.py::test_c[1]") == "tests/core/test_layout.py"
