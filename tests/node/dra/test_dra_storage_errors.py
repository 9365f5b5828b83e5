"""Disk errors on the DRA hot path (issue 23, items 1 and 4), against the DRA kubelet double.

The DRA checkpoint and the CDI specs are the driver's state on disk. When a write of either
fails — injected ``ENOSPC`` (any user), or the checkpoint directory remounted read-only mid-run
(root) — the claim's prepare fails with an error naming the cause, every slot it claimed is
given back, the old checkpoint stays valid, nothing is answered that is not recorded, and
kubelet's retry succeeds as soon as the disk works again (no restart). An unprepare that
cannot be recorded fails and keeps the claim, so kubelet's retry finishes it.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.core.ledger.decisions import Owner, held_count
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import StoreUnavailableError
from agent.core.store.files import TMP_PREFIX
from agent.node.dra.checkpoint import Checkpoint, PendingClaim
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble, PrepareError, UnprepareError
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_e2e import published

REAL_WRITE = os.write
INSTANCE = "cam-8120fe"
KEY = ObjectKey("default", INSTANCE)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def dra(
    api: ApiServerDouble, tmp_path: Path
) -> AsyncIterator[tuple[DpNode, DraKubeletDouble]]:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    try:
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=20)
        await eventually(
            lambda: len(published(api).get(INSTANCE, [])) == 2, within=20, what="slices"
        )
        yield node, kubelet
    finally:
        await kubelet.stop()
        await node.stop()


class FailingWrites:
    """``os.write`` failing with ``error`` for temp files whose name contains ``marker``,
    after ``after`` successful ones, while ``active``."""

    def __init__(self, marker: str, error: int = errno.ENOSPC, after: int = 0) -> None:
        self.marker = marker
        self.error = error
        self.after = after
        self.active = True

    def __call__(self, fd: int, data: bytes | memoryview) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if self.active and TMP_PREFIX in target and self.marker in target:
            if self.after == 0:
                raise OSError(self.error, os.strerror(self.error))
            self.after -= 1
        return REAL_WRITE(fd, data)


def _claim(api: ApiServerDouble, name: str) -> str:
    uid: str = create_claim(api, "default", name)["metadata"]["uid"]
    allocate_claim(api, "default", name, "node-a", pod_name=f"pod-{name}", pod_uid=f"pod-{name}")
    return uid


def _checkpoint(node: DpNode) -> Checkpoint:
    book = Checkpoint(node.dra_dir / "checkpoint.json")
    book.load()  # raises if the file were not whole
    return book


def _held(api: ApiServerDouble) -> int:
    return held_count(api_instances(api)[INSTANCE])


@pytest.mark.parametrize(
    ("marker", "after", "cause"),
    [
        pytest.param("checkpoint.json", 0, "DRA checkpoint unavailable", id="preparing"),
        pytest.param("checkpoint.json", 1, "DRA checkpoint unavailable", id="prepared"),
        pytest.param("k8s.akri.sh-device_", 0, "writing the CDI spec failed", id="cdi"),
    ],
)
async def test_prepare_refused_when_its_state_cannot_be_written(
    api: ApiServerDouble,
    dra: tuple[DpNode, DraKubeletDouble],
    monkeypatch: pytest.MonkeyPatch,
    marker: str,
    after: int,
    cause: str,
) -> None:
    node, kubelet = dra
    uid = _claim(api, "c1")
    failing = FailingWrites(marker, after=after)
    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(PrepareError) as info:
        await kubelet.prepare("pod-c1", [("default", uid, "c1")])
    message = str(info.value)
    assert cause in message and "No space left on device (ENOSPC)" in message, message
    assert _held(api) == 0  # every slot it claimed was given back
    assert uid not in _checkpoint(node).claims  # not recorded, not answered
    assert list(node.cdi_dir.glob("*.json")) == []
    assert list(node.dra_dir.glob(f"{TMP_PREFIX}*")) == []
    failing.active = False  # space returns: kubelet's retry succeeds, no restart
    results = await kubelet.prepare("pod-c1", [("default", uid, "c1")])
    assert results[uid].devices and not results[uid].error
    assert _held(api) == 1
    assert uid in _checkpoint(node).claims


async def test_unprepare_refused_when_it_cannot_be_recorded_then_finished(
    api: ApiServerDouble,
    dra: tuple[DpNode, DraKubeletDouble],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, kubelet = dra
    uid = _claim(api, "c1")
    await kubelet.prepare("pod-c1", [("default", uid, "c1")])
    failing = FailingWrites("checkpoint.json", errno.EIO)
    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(UnprepareError) as info:
        await kubelet.remove_pod("pod-c1")
    assert "Input/output error (EIO)" in str(info.value)
    assert uid in _checkpoint(node).claims  # still recorded: the retry finds it
    assert node.agent.dra_state is not None and uid in node.agent.dra_state.checkpoint.claims
    failing.active = False
    await kubelet.unprepare([("default", uid, "c1")], driver="akri.sh")
    assert uid not in _checkpoint(node).claims
    assert _held(api) == 0


def _root_problem() -> str | None:
    return None if os.geteuid() == 0 else "needs root to remount the DRA directory read-only"


@pytest.mark.skipif(_root_problem() is not None, reason=_root_problem() or "")
async def test_read_only_dra_directory_mid_run(
    api: ApiServerDouble, dra: tuple[DpNode, DraKubeletDouble]
) -> None:
    node, kubelet = dra
    first = _claim(api, "c1")
    await kubelet.prepare("pod-c1", [("default", first, "c1")])
    directory = node.dra_dir
    run: Callable[..., object] = subprocess.run
    run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        second = _claim(api, "c2")
        with pytest.raises(PrepareError) as info:
            await kubelet.prepare("pod-c2", [("default", second, "c2")])
        assert "Read-only file system (EROFS)" in str(info.value)
        assert "DRA checkpoint unavailable" in str(info.value)
        assert _held(api) == 1  # only the first claim's slot
        run(["mount", "-o", "remount,rw,bind", str(directory)], check=True)
        results = await kubelet.prepare("pod-c2", [("default", second, "c2")])
        assert results[second].devices
        assert _held(api) == 2
    finally:
        run(["umount", "-l", str(directory)], check=False)
    book = _checkpoint(node)
    assert {first, second} <= set(book.claims)


async def test_reclaim_keeps_going_through_store_and_disk_errors(
    api: ApiServerDouble,
    dra: tuple[DpNode, DraKubeletDouble],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slot of an interrupted prepare whose claim is gone: while the store refuses the
    release (and the disk the checkpoint), each pass says so in one line and the slot stays
    due; once both work, it is freed without waiting a new grace, no pass ever fails."""
    node, _ = dra
    uid = _claim(api, "c1")
    claim = api.get("resourceclaims.resource.k8s.io", "c1", "default")
    assert claim is not None
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    state = node.agent.dra_state
    reclaimer = node.dra_reclaimer
    assert state is not None and reclaimer is not None
    state.checkpoint.record_preparing(PendingClaim(uid, "default", "c1"))
    await node.ledger.claim(KEY, device, Owner.claim(uid, "node-a"))
    refusing = [True]
    real_update = node.store.update

    async def update(instance: Instance) -> Instance:
        if refusing[0]:
            raise StoreUnavailableError("the API server is not answering")
        return await real_update(instance)

    monkeypatch.setattr(node.store, "update", update)
    failing = FailingWrites("checkpoint.json")
    monkeypatch.setattr(os, "write", failing)
    api.delete("resourceclaims.resource.k8s.io", "c1", "default")
    await eventually(
        lambda: any("cannot free DRA slot" in r.getMessage() for r in caplog.records),
        within=20,
        what="a refused release",
    )
    assert _held(api) == 1
    refusing[0] = False
    await eventually(lambda: _held(api) == 0, within=20, what="the slot freed")
    assert any("could not drop finished claims" in r.getMessage() for r in caplog.records)
    assert uid in state.checkpoint.pending  # the write failed: memory still matches the file
    assert not [r for r in caplog.records if "reclaim pass failed" in r.getMessage()]
