"""Shared slices in both nodeSelector forms pass deploy/base/resourceslice-policy.yaml for the
nodes they list (the current ``kubernetes.io/hostname In`` term and the legacy
``matchFields metadata.name In`` form earlier agents stored)."""

from __future__ import annotations

from agent.node.dra.slices import Pool
from tests.deploy.test_deploy_policy import admit


def test_slices_in_the_legacy_selector_form_are_still_recognised() -> None:
    """Slices stored by agents that selected nodes with ``matchFields metadata.name In`` stay
    writable by the nodes they list (adoption rewrites them into the hostname-label form)."""
    legacy = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "akri.sh-cam-s-x"},
        "spec": {
            "driver": "akri.sh",
            "pool": {"name": "cam-s", "generation": 1, "resourceSliceCount": 1},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {
                                "key": "metadata.name",
                                "operator": "In",
                                "values": ["node-a", "node-b"],
                            }
                        ]
                    }
                ]
            },
        },
    }
    assert admit("DELETE", legacy, node="node-b")[0]
    assert not admit("DELETE", legacy, node="node-c")[0]
    rewritten = {
        **legacy,
        "spec": {**legacy["spec"], **Pool("cam-s", None, ("node-b", "node-c")).slice_specs()[0]},
    }
    # node-b publishes the new selector; it may rewrite the slice it was listed in
    assert admit("UPDATE", rewritten, old=legacy, node="node-b")[0]
    assert not admit("UPDATE", rewritten, old=legacy, node="node-c")[0]
