"""The publisher's slice cache keeps of another node's local slice only what the agent reads
of it (its mode label, its identity, its pool), not its devices; this node's own slices and the
shared ones stay whole, since the publisher compares and rewrites them (issue 41)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.core.kube import make_kube_client
from agent.core.store.informer import without_managed_fields
from agent.node.dra.name_paths import DEVICE_PLUGINS, DRA, MODE_LABEL
from agent.node.dra.publisher import SlicePublisher
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import eventually
from tests.node.dra.test_dra_e2e import SLICES
from tests.node.dra.test_dra_publisher_sync import stored_shared_slice
from tests.node.dra.test_dra_units import inst


def foreign_local_slice(node: str, mode: str) -> dict[str, Any]:
    """Node ``node``'s local slice as its agent publishes it: ten devices, its mode label, an
    annotation."""
    devices = [
        {"name": f"cam-{i}", "attributes": {"path": {"string": f"/dev/v{i}"}}} for i in range(10)
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": f"akri.sh-{node}-abcde",
            "labels": {"akri.sh/pool": node, MODE_LABEL: mode},
            "annotations": {"note": "an annotation the agent never reads of it"},
        },
        "spec": {
            "driver": "akri.sh",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


async def test_another_nodes_local_slice_is_cached_without_its_devices(tmp_path: Path) -> None:
    """From the first list and from the watch: another node's local slice is cached as its
    identity, labels, driver, nodeName and pool (node_paths still reads its mode), this node's
    own slice and a shared slice whole. Before: every slice whole, devices and all."""
    async with ApiServerDouble() as api:
        api.create(foreign_local_slice("n2", DRA))
        shared = stored_shared_slice(("n2", "n3"), 1, None)  # lists other nodes: left alone
        del shared["metadata"]["resourceVersion"]
        api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", **shared})
        client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        instances = [inst("cam", False, ("n1",), 2)]
        pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())
        pub.extended_path = DRA
        await pub.load()
        await pub.start()
        try:
            api.create(foreign_local_slice("n3", DEVICE_PLUGINS))  # arrives through the watch
            cache = pub._informer.cache
            await eventually(
                lambda: (
                    "/akri.sh-n3-abcde" in cache
                    and any((o.get("spec") or {}).get("nodeName") == "n1" for o in cache.values())
                ),
                what="n3's slice watched and n1's own slice published",
            )
            for node in ("n2", "n3"):
                stored = api.get(SLICES, f"akri.sh-{node}-abcde") or {}
                meta = stored["metadata"]
                assert cache[f"/akri.sh-{node}-abcde"] == {
                    "metadata": {
                        "name": meta["name"],
                        "resourceVersion": meta["resourceVersion"],
                        "uid": meta["uid"],
                        "labels": meta["labels"],
                    },
                    "spec": {
                        "driver": "akri.sh",
                        "nodeName": node,
                        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    },
                }
            assert pub.node_paths() == {"n1": DRA, "n2": DRA, "n3": DEVICE_PLUGINS}
            for obj in api.list(SLICES):
                if obj["spec"].get("nodeName") in ("n2", "n3"):
                    continue
                # this node's own slice and the shared one: whole
                assert cache[f"/{obj['metadata']['name']}"] == without_managed_fields(obj)
            (own,) = (o for o in cache.values() if o["spec"].get("nodeName") == "n1")
            assert len(own["spec"]["devices"]) == 2
        finally:
            await pub.close()


async def test_another_nodes_device_changes_cost_no_sync_its_mode_change_does(
    tmp_path: Path,
) -> None:
    """A sync walks every slice of the cluster. Another node's local slice changing its
    devices changes nothing this node publishes (it caches none of them): no sync. Before,
    each such write cost one — 21 % of a core at 50 foreign writes a second
    (benchmarks/fleet.py, slice_churn). Its mode label changing still does, and node_paths
    says the new mode."""
    async with ApiServerDouble() as api:
        api.create(foreign_local_slice("n2", DRA))
        client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        instances = [inst("cam", False, ("n1",), 2)]
        pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())
        pub.extended_path = DRA
        await pub.load()
        await pub.start()
        try:
            cache = pub._informer.cache
            await eventually(
                lambda: any((o.get("spec") or {}).get("nodeName") == "n1" for o in cache.values()),
                what="n1's own slice published",
            )
            for change in range(3):  # devices only: three writes the watch brings
                stored = api.get(SLICES, "akri.sh-n2-abcde") or {}
                await eventually(lambda: not pub._wake.is_set(), what="the publisher idle")
                syncs = pub.syncs
                stored["spec"]["devices"][0]["attributes"]["busy"] = {"bool": change % 2 == 0}
                version = api.apply(stored)["metadata"]["resourceVersion"]
                await eventually(
                    lambda v=version: (
                        cache["/akri.sh-n2-abcde"]["metadata"]["resourceVersion"] == v
                    ),
                    what="the device change watched",
                )
                assert not pub._wake.is_set() and pub.syncs == syncs, "a sync for n2's devices"
            stored = api.get(SLICES, "akri.sh-n2-abcde") or {}
            syncs = pub.syncs
            stored["metadata"]["labels"][MODE_LABEL] = DEVICE_PLUGINS
            api.apply(stored)
            await eventually(lambda: pub.syncs > syncs, what="a sync for n2's mode")
            await eventually(lambda: pub.node_paths().get("n2") == DEVICE_PLUGINS, what="n2's mode")
        finally:
            await pub.close()
