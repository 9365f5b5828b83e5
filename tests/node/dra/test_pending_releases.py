"""Pending releases in the DRA checkpoint (issue 39.2): a claim unprepared on the node while
the API refused to free its slots stays on record until the release is done. The agent-level
paths (a 503 for a moment, the RBAC gone then an agent installed again) are in
test_leaving.py."""

from __future__ import annotations

import json
from pathlib import Path

from agent.core.model.keys import ObjectKey
from agent.node.deviceplugin.held_slots import HeldSlot
from agent.node.dra.checkpoint import (
    Checkpoint,
    PendingClaim,
    PendingRelease,
    PreparedClaim,
    PreparedDevice,
)
from agent.node.dra.reclaim import ClaimSlotState, classify
from agent.node.dra.slices import DRIVER

CAMS = ObjectKey("default", "cams-a")
OTHER = ObjectKey("ops", "cams-b")
VALUE = "D:uid-1:n1"
DEVICE = PreparedDevice(("req",), "n1", "cams-a-0", "cams-a", "cams-a-0", ("k=x",))
CLAIM = PreparedClaim("uid-1", "ns", "c", (DEVICE,))


def _release(*instances: ObjectKey) -> PendingRelease:
    return PendingRelease("uid-1", "ns", "c", VALUE, instances)


def test_a_release_pending_replaces_its_claim_in_one_write(tmp_path: Path) -> None:
    path = tmp_path / "cp" / "checkpoint.json"
    checkpoint = Checkpoint(path)
    checkpoint.record_preparing(PendingClaim("uid-1", "ns", "c"))
    checkpoint.record_prepared(CLAIM)
    checkpoint.record_release_pending(_release(CAMS))
    assert checkpoint.claims == {} and checkpoint.pending == {}
    again = Checkpoint(path)
    again.load()
    assert again.releases == {"uid-1": _release(CAMS)}
    assert again.claims == {}
    document = json.loads(path.read_text())
    assert document["version"] == 2  # an addition to version 2: older agents read the file
    assert document["pendingReleases"]["uid-1"] == {
        "namespace": "ns",
        "name": "c",
        "value": VALUE,
        "instances": [{"namespace": "default", "name": "cams-a"}],
    }
    # a second refusal for the same claim (kubelet retried) adds to the record
    checkpoint.record_release_pending(_release(OTHER))
    assert checkpoint.releases["uid-1"].instances == (CAMS, OTHER)


def test_a_checkpoint_without_pending_releases_is_what_older_agents_wrote(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoint.json"
    older = {
        "version": 2,
        "preparedClaims": {
            "uid-1": {
                "uid": "uid-1",
                "namespace": "ns",
                "name": "c",
                "devices": [
                    {
                        "request_names": ["req"],
                        "pool": "n1",
                        "device": "cams-a-0",
                        "instance": "cams-a",
                        "slot": "cams-a-0",
                        "cdi_device_ids": ["k=x"],
                        "share_id": None,
                        "namespace": "default",
                    }
                ],
            }
        },
        "preparingClaims": {},
    }
    path.write_text(json.dumps(older))
    checkpoint = Checkpoint(path)
    checkpoint.load()  # an older checkpoint loads: no pending release
    assert checkpoint.claims == {"uid-1": CLAIM} and checkpoint.releases == {}
    checkpoint.save()
    assert json.loads(path.read_text()) == older  # and is written back unchanged


def test_releases_leave_the_record_as_they_are_done(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.record_release_pending(_release(CAMS, OTHER))
    checkpoint.released("uid-1", [CAMS])
    assert checkpoint.releases["uid-1"].instances == (OTHER,)
    checkpoint.released("uid-1", [OTHER])
    assert checkpoint.releases == {}
    assert "pendingReleases" not in json.loads(checkpoint.path.read_text())
    checkpoint.released("uid-1", [OTHER])  # nothing pending: nothing to do


def test_a_pending_release_keeps_the_checkpoint_on_the_node(tmp_path: Path) -> None:
    """An uninstalled agent removes its empty checkpoint; one with a release pending stays
    (and its directory), for the next agent here."""
    checkpoint = Checkpoint(tmp_path / "akri.sh" / "checkpoint.json")
    checkpoint.record_release_pending(_release(CAMS))
    assert not checkpoint.remove_if_empty()
    assert checkpoint.path.exists()
    # what is on disk decides too: another instance of the file with the record
    empty = Checkpoint(checkpoint.path)
    assert not empty.remove_if_empty() and checkpoint.path.exists()
    checkpoint.released("uid-1", [CAMS])
    assert checkpoint.remove_if_empty()
    assert not checkpoint.path.parent.exists()


def test_a_claim_prepared_again_drops_its_pending_release(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.record_release_pending(_release(CAMS))
    checkpoint.record_preparing(PendingClaim("uid-1", "ns", "c"))
    assert checkpoint.releases == {}  # its old slots, unused by the new preparation: stale


def test_a_slot_with_a_pending_release_is_releasable_not_untraceable(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    slot = HeldSlot(CAMS, "cams-a-0", VALUE, DRIVER, "uid-1")
    assert classify(slot, checkpoint, None, lambda _: "n1") is ClaimSlotState.UNTRACEABLE
    checkpoint.record_release_pending(_release(CAMS))
    assert classify(slot, checkpoint, None, lambda _: "n1") is ClaimSlotState.RELEASING
