"""Sockets a killed agent left in kubelet's device-plugin directory.

Each plugin start serves a new timestamped socket (``akri.sh-<resource>-<ms>.sock``,
``endpoint.socket_file_name``); a clean stop removes it, a ``kill -9`` does not, and every
restart would add one more. At start the agent removes the sockets that are unmistakably its
own and dead: the name has our shape, it is a socket, and nothing answers on it (connection
refused). ``kubelet.sock``, other vendors' plugins and a live socket (another agent process
that still serves, e.g. during a rollout) are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import stat
from pathlib import Path

from agent.node.deviceplugin.registration import KUBELET_SOCKET

log = logging.getLogger(__name__)

# akri.sh-<resource, maybe shortened with an 8-hex digest>-<13+ digit milliseconds>.sock, or
# (a very long directory) only the digest
OWN_SOCKET = re.compile(r"^(akri\.sh-.+|[0-9a-f]{1,8})-\d{13,}\.sock$")


def is_own_socket_name(name: str) -> bool:
    return name != KUBELET_SOCKET and OWN_SOCKET.match(name) is not None


def is_dead_socket(path: Path) -> bool:
    """A unix socket file nobody listens on (connect is refused). Anything else — not a
    socket, a listener, a connect that fails otherwise — counts as alive."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError as error:
            return error.errno == errno.ECONNREFUSED
        return False


def remove_stale_sockets(directory: Path, keep: frozenset[str] = frozenset()) -> list[str]:
    """Remove this agent's dead sockets from ``directory`` (names in ``keep`` stay); returns
    the names removed."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        if name in keep or not is_own_socket_name(name):
            continue
        path = directory / name
        if not is_dead_socket(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(name)
    if removed:
        log.info(
            "removed %d socket(s) a previous run left in %s: %s",
            len(removed),
            directory,
            ", ".join(removed),
        )
    return removed
