"""Issue 30 (3): a hung API server no longer stalls kubelet admission, and a claim write that
lands after Allocate gave up is freed at once (the slot is not offered meanwhile).

Before: Allocate waited the API client's whole timeout (kubelet admits one pod at a time, so
the next pod waited behind it), and when the API server resumed it applied the timed-out
write — a slot held for a pod kubelet had rejected, until the reclaimer's grace ran out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.core.ledger.decisions import held_count
from agent.core.model.keys import ObjectKey
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

INSTANCE = "cam-8120fe"
IL = f"akri.sh/{INSTANCE}"
KEY = ObjectKey("default", INSTANCE)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_allocate_answers_within_the_deadline_and_a_late_write_is_freed(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    # a long reclaim grace: only the settling of the unknown write can free the slot here
    node = await start_dp_node(api, "node-a", tmp_path, reclaim_grace=600)
    try:
        await node.kubelet.wait_registered(IL, timeout=10)
        await eventually(lambda: node.kubelet.allocatable(IL) == 2, 10)
        node.ledger.claim_timeout = 1.0  # --slot-write-timeout (the store's own timeout is 5 s)
        hang = api.hang(verb="update", resource="instances")

        pod = await node.kubelet.admit_pod("default", "p1", [("c", {IL: 1})])

        # answered while the API server still holds the write: by the deadline, not the
        # client's timeout
        assert not pod.admitted
        assert pod.grpc_code == grpc.StatusCode.UNAVAILABLE
        assert "did not answer the claim within 1s" in (pod.grpc_details or "")
        assert hang.held == 1
        (slot,) = node.ledger.unsettled(KEY)
        # held back: not offered while the write may still land
        await eventually(lambda: node.kubelet.allocatable(IL) == 1, 10, "slot held back")

        hang.release()  # the API server resumes and applies the write kubelet gave up on
        await eventually(lambda: hang.late == 1, 10, "late write applied")
        # ... and the agent frees it (the reclaimer would wait 600 s) and offers it again
        await eventually(
            lambda: held_count(api_instances(api)[INSTANCE]) == 0, 15, "late slot freed"
        )
        await eventually(lambda: not node.ledger.unsettled(KEY), 15, "settled")
        await eventually(lambda: node.kubelet.allocatable(IL) == 2, 10, "offered again")
        assert slot in api_instances(api)[INSTANCE].device_usage
        # the API server answers again: the next pod is admitted as usual
        assert (await node.kubelet.admit_pod("default", "p2", [("c", {IL: 1})])).admitted
    finally:
        await node.stop()
