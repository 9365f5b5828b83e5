"""Disk errors on the device-plugin hot path (issue 23, item 4), against the kubelet double.

A local agent (file store) serves its device plugins to a kubelet double; its state directory
then fails under it: an injected ``ENOSPC`` part-way through a request (any user), or a
read-only remount of the whole state directory (root). Each time the Allocate is refused with
``UNAVAILABLE`` naming the cause, every slot claimed earlier in the same request is given
back, nothing is recorded that kubelet was not given, kubelet gets the device list again, and
the agent grants normally as soon as the disk works again (no restart).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from agent.core.model.keys import ObjectKey
from agent.core.store.files import TMP_PREFIX
from agent.core.store.local import (
    LocalInstanceStore,
    instance_path,
    load_instance_file,
    read_state_dir,
)
from agent.node.app import Agent
from agent.node.settings import AgentSettings
from tests.doubles.kubelet_double import KubeletDouble
from tests.harness.k8s_nodes import debug_echo_configuration, eventually

NODE = "node-a"
IL = "akri.sh/cam-8120fe"  # debugEcho device "foo0" of Configuration "cam"
CL = "akri.sh/cam"
KEY = ObjectKey("default", "cam-8120fe")
REAL_WRITE = os.write


@dataclass
class LocalNode:
    base: Path
    state_dir: Path
    kubelet: KubeletDouble
    agent: Agent

    def stored(self) -> dict[str, str]:
        path = instance_path(self.state_dir / "instances", KEY)
        return load_instance_file(path).device_usage

    def held(self) -> list[str]:
        """Every held slot value of every Instance on disk."""
        return sorted(
            value
            for instance in read_state_dir(self.state_dir)
            for value in instance.device_usage.values()
            if value
        )


def _settings(base: Path, state_dir: Path, config: Path) -> AgentSettings:
    return AgentSettings(
        local=True,
        state_dir=state_dir,
        config=[config],
        node_name=NODE,
        log_level="INFO",
        local_offline_grace=0,
        shared_offline_grace=0,
        debug_echo=True,
        debug_echo_shared=True,
        debug_echo_availability_file=base / "avail",
        kubeconfig=None,
        namespace=None,
        device_plugin_dir=base / "device-plugins",
        pod_resources_socket=base / "pod-resources.sock",
        reclaim_interval=0.2,
        reclaim_grace=0.5,
        dra=False,
        plugins_registry_dir=base / "plugins_registry",
        dra_plugin_dir=base / "dra",
        cdi_dir=base / "cdi",
        udev_monitor_source=None,
        poll_interval=0.05,
        discovery_handlers_dir=base / "dh",
        external_handlers=False,
    )


async def _start(state_dir: Path) -> AsyncIterator[LocalNode]:
    # unix socket paths are limited to 108 bytes: a short base directory
    base = Path(tempfile.mkdtemp(prefix="dp-disk-", dir="/tmp"))
    config = base / "cam.yaml"
    config.write_text(yaml.safe_dump(debug_echo_configuration("cam", ("foo0", "foo1"), 3)))
    settings = _settings(base, state_dir, config)
    assert settings.device_plugin_dir is not None
    settings.device_plugin_dir.mkdir(parents=True)
    kubelet = KubeletDouble(settings.device_plugin_dir, settings.pod_resources_socket)
    await kubelet.start()
    store = LocalInstanceStore(state_dir, [config], poll_interval=0.05)
    agent = Agent(settings, store, freeze_gc=False)
    await agent.start()
    node = LocalNode(base, state_dir, kubelet, agent)
    try:
        await kubelet.wait_registered(IL, timeout=20)
        await kubelet.wait_registered(CL, timeout=20)
        await eventually(lambda: kubelet.allocatable(IL) == 3, within=20, what="IL devices")
        # one free virtual device per Instance with room: foo0's and foo1's
        await eventually(lambda: kubelet.allocatable(CL) == 2, within=20, what="CL devices")
        yield node
    finally:
        await agent.stop()
        await kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[LocalNode]:
    async for started in _start(tmp_path / "state"):
        yield started


def _instance_file_fails(after: int, *, once: bool = True) -> tuple[list[int], object]:
    """An ``os.write`` that fails with ENOSPC on writes of Instance state (a temp file or a
    journal) after ``after`` successful ones: once (space came back at once), or until
    ``state[0]`` is set to -1."""
    state = [after]

    def write(fd: int, data: bytes | memoryview) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        # an Instance file's temp file, or its slot journal (agent/core/store/journal.py)
        name = target.rsplit("/", 1)[-1]
        if (
            "/instances/" in target
            and name.startswith((f"{TMP_PREFIX}cam-", "cam-"))
            and (state[0] >= 0)
        ):
            if state[0] == 0:
                if once:
                    state[0] = -1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            state[0] -= 1
        return REAL_WRITE(fd, data)

    return state, write


async def test_a_request_failing_part_way_rolls_back_and_resends(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two slots in one container: the first claim is written, the second hits ENOSPC. The
    request is refused with UNAVAILABLE naming the cause, the first slot is given back, and
    kubelet receives the device list again."""
    sends_before = node.kubelet.list_and_watch_count[IL]
    _, write = _instance_file_fails(after=1)
    monkeypatch.setattr(os, "write", write)
    pod = await node.kubelet.admit_pod("default", "two", [("c", {IL: 2})])
    assert not pod.admitted
    assert "Unavailable" in (pod.message or "") or "UNAVAILABLE" in (pod.message or "")
    assert "No space left on device (ENOSPC)" in (pod.message or "")
    assert node.held() == []  # the roll-back is written before the refusal
    await eventually(
        lambda: node.kubelet.list_and_watch_count[IL] > sends_before, what="list re-sent"
    )
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
    again = await node.kubelet.admit_pod("default", "again", [("c", {IL: 2})])
    assert again.admitted, again.message
    assert sorted(v for v in node.stored().values() if v) == [NODE, NODE]


async def test_a_roll_back_the_full_disk_refuses_is_reclaimed_once_space_returns(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk stays full: the roll-back cannot be written either, so the first slot stays
    recorded as held (recorded but not granted: never the reverse). Once space returns the
    reclaimer frees it (kubelet shows no container using it), without a restart."""
    state, write = _instance_file_fails(after=1, once=False)
    monkeypatch.setattr(os, "write", write)
    pod = await node.kubelet.admit_pod("default", "two", [("c", {IL: 2})])
    assert not pod.admitted and "ENOSPC" in (pod.message or "")
    assert node.held() == [NODE]
    state[0] = -1  # space returns
    await eventually(lambda: node.held() == [], within=30, what="the slot reclaimed")
    again = await node.kubelet.admit_pod("default", "again", [("c", {IL: 2})])
    assert again.admitted, again.message


async def test_a_failing_second_container_rolls_back_the_first(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Configuration-level, one Allocate with two containers (as a plugin may be asked): the
    second container's claim fails, so the first container's slot is given back too."""
    from agent.node.deviceplugin.service import AllocationError

    plugin = node.agent.plugins
    assert plugin is not None
    logic = plugin.configuration_plugins["cam"].service.logic
    _, write = _instance_file_fails(after=1)
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(AllocationError) as caught:
        await logic.allocate([["cam-0"], ["cam-1"]])
    assert "ENOSPC" in str(caught.value)
    assert node.held() == []


def _root_problem() -> str | None:
    return None if os.geteuid() == 0 else "needs root to remount the state directory read-only"


@pytest.fixture
def bound_state(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "bound"
    directory.mkdir()
    if _root_problem() is not None:
        pytest.skip(_root_problem() or "")
    try:
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot bind-mount here: {error}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode},bind", str(directory)], check=True)


async def test_read_only_state_dir_refuses_then_recovers(
    bound_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async for node in _start(bound_state / "state"):
        _remount(bound_state, "ro")
        try:
            refused = await node.kubelet.admit_pod("default", "ro", [("c", {IL: 1})])
            cl_refused = await node.kubelet.admit_pod("default", "ro-cl", [("c", {CL: 1})])
        finally:
            _remount(bound_state, "rw")
        for pod in (refused, cl_refused):
            assert not pod.admitted
            assert "Read-only file system (EROFS)" in (pod.message or ""), pod.message
        assert node.held() == []
        assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
        admitted = await node.kubelet.admit_pod("default", "rw", [("c", {IL: 1})])
        assert admitted.admitted, admitted.message
        assert list(node.stored().values()).count(NODE) == 1


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    if _root_problem() is not None:
        pytest.skip(_root_problem() or "")
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mountpoint)], check=True
        )
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def _fill(directory: Path) -> list[Path]:
    chunks: list[Path] = []
    while True:
        chunk = directory / f"filler-{len(chunks)}"
        try:
            chunk.write_bytes(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
            chunk.unlink(missing_ok=True)
            return chunks
        chunks.append(chunk)


async def test_the_reviews_full_tmpfs_scenario(tmpfs: Path) -> None:
    """The review's scenario end to end: Allocates against a local agent whose state dir is a
    full 256 KiB tmpfs. Every pod kubelet admitted has its slot on disk, every refused one
    has nothing there and was told why; after freeing the space the same agent grants again,
    and a restart finds every grant (it used to exit 3 with the slot gone)."""
    state = tmpfs / "state"
    admitted: list[str] = []
    async for node in _start(state):
        chunks = _fill(tmpfs)
        refusals = []
        for index in range(3):
            pod = await node.kubelet.admit_pod("default", f"p{index}", [("c", {IL: 1})])
            if pod.admitted:
                admitted.append(pod.container("c").all_devices()[0])
            else:
                refusals.append(pod.message or "")
        assert refusals, "a full disk refused nothing"
        assert all("No space left on device (ENOSPC)" in m for m in refusals), refusals
        held = {slot for slot, value in node.stored().items() if value == NODE}
        assert held == set(admitted)  # nothing granted that is not recorded, nor the reverse
        for chunk in chunks:
            chunk.unlink()
        late = await node.kubelet.admit_pod("default", "late", [("c", {IL: 1})])
        assert late.admitted, late.message
        admitted.append(late.container("c").all_devices()[0])
    async for node in _start(state):  # a restart (same state, new agent and kubelet)
        held = {slot for slot, value in node.stored().items() if value == NODE}
        assert held == set(admitted)
