"""Issue 30 (4, 5): what a killed agent left is swept at the next start — its CDI temp files and
its old timestamped device-plugin sockets — and nothing else (kubelet's socket, other vendors'
sockets and files, a socket something still listens on, a write younger than the start)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.node.deviceplugin.strays import remove_stale_sockets
from agent.node.dra.cdi import CdiWriter
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually


def dead_socket(path: Path) -> None:
    """A socket file nobody listens on: what ``kill -9`` leaves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


@contextmanager
def live_socket(path: Path) -> Iterator[None]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()
        yield


def test_only_our_dead_sockets_are_removed(tmp_path: Path) -> None:
    ours = ["akri.sh-cam-8120fe-1732540000000.sock", "akri.sh-cam-1732540000001.sock"]
    for name in ours:
        dead_socket(tmp_path / name)
    dead_socket(tmp_path / "kubelet.sock")  # kubelet's, even when it is down
    dead_socket(tmp_path / "nvidia-gpu.sock")  # another vendor's
    dead_socket(tmp_path / "akri.sh-cam.sock")  # not our timestamped shape
    (tmp_path / "akri.sh-file-1732540000002.sock").write_text("not a socket")
    (tmp_path / "kubelet_internal_checkpoint").write_text("{}")
    with live_socket(tmp_path / "akri.sh-live-1732540000003.sock"):
        removed = remove_stale_sockets(tmp_path)
    assert sorted(removed) == sorted(ours)
    assert sorted(os.listdir(tmp_path)) == [
        "akri.sh-cam.sock",
        "akri.sh-file-1732540000002.sock",
        "akri.sh-live-1732540000003.sock",
        "kubelet.sock",
        "kubelet_internal_checkpoint",
        "nvidia-gpu.sock",
    ]


def test_only_our_old_cdi_temp_files_are_removed(tmp_path: Path) -> None:
    ours = tmp_path / ".tmp-k8s.akri.sh-device_5f2c.json.77.0"
    ours.write_text("{")
    old = time.time() - 60
    os.utime(ours, (old, old))
    in_flight = tmp_path / ".tmp-k8s.akri.sh-device_9a9a.json.78.0"
    in_flight.write_text("{")  # younger than the start: another process's write
    others = [
        tmp_path / ".tmp-nvidia.com-gpu.json.12.0",
        tmp_path / "k8s.akri.sh-device_5f2c.json",
    ]
    for path in others:
        path.write_text("{}")
        os.utime(path, (old, old))
    removed = CdiWriter(tmp_path).remove_strays(started=time.time() - 1)
    assert removed == [ours.name]
    assert in_flight.exists() and all(p.exists() for p in others)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_the_agent_sweeps_both_at_start(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    # unix socket paths are limited to 108 bytes: a short directory, as the harness uses
    base = Path(tempfile.mkdtemp(prefix="sweep-", dir="/tmp"))
    (base / "device-plugins").mkdir(parents=True)
    (base / "cdi").mkdir()
    stale = [f"akri.sh-cam-8120fe-{1732540000000 + i}.sock" for i in range(3)]
    for name in stale:
        dead_socket(base / "device-plugins" / name)
    temp = base / "cdi" / ".tmp-k8s.akri.sh-device_5f2c.json.77.0"
    temp.write_text("{")
    old = time.time() - 60
    os.utime(temp, (old, old))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True, base=base)
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe", timeout=10)
        names = os.listdir(base / "device-plugins")
        assert not set(stale) & set(names)
        assert "kubelet.sock" in names
        await eventually(lambda: not temp.exists(), 5, "CDI temp file removed")
    finally:
        await node.stop()
