"""The pure steps of this node's path follower (agent/node/dra/path_follower.py): what a change
of the Node leads to, how a switch is said, when the ResourceClaims are followed. The follower
itself runs in test_extended_path.py, test_auto_follows_classes.py and test_claims_followed.py."""

from __future__ import annotations

from agent.node.dra.extended import DEVICE_PLUGINS, DRA, PathDecision
from agent.node.dra.path_follower import (
    ClaimsStep,
    NodeChangeStep,
    after_node_change,
    claims_step,
    switch_decision,
)

ON_DRA = PathDecision(DRA, "kubelet 1.36")
WAITING = PathDecision(DEVICE_PLUGINS, "no DeviceClass yet", awaits_classes=True)
OFF = PathDecision(DEVICE_PLUGINS, "runtime-cdi=false")


def test_unreadable_classes_leave_the_path_as_it_is() -> None:
    for decision in (ON_DRA, WAITING, OFF):
        for current in (DRA, DEVICE_PLUGINS):
            assert after_node_change(decision, classes_read=False, current=current) == (
                NodeChangeStep()
            )


def test_a_node_on_dra_whose_classes_went_stays_on_dra() -> None:
    assert after_node_change(WAITING, classes_read=True, current=DRA) == NodeChangeStep()


def test_a_changed_node_takes_the_new_path_either_way() -> None:
    assert after_node_change(ON_DRA, classes_read=True, current=DEVICE_PLUGINS) == (
        NodeChangeStep(take=True)
    )
    assert after_node_change(OFF, classes_read=True, current=DRA) == NodeChangeStep(take=True)
    assert after_node_change(ON_DRA, classes_read=True, current=DRA) == NodeChangeStep()


def test_a_device_plugin_node_waiting_for_classes_follows_them() -> None:
    assert after_node_change(WAITING, classes_read=True, current=DEVICE_PLUGINS) == (
        NodeChangeStep(take=False, follow_classes=True)
    )


def test_a_switch_says_where_it_came_from_and_that_nothing_is_released() -> None:
    said = switch_decision(ON_DRA, DEVICE_PLUGINS, "the Node changed after the start")
    assert said.path == DRA
    assert said.reason == (
        "kubelet 1.36 (the Node changed after the start: switched from device-plugins without "
        "a restart; slots held either way stay held)"
    )
    assert switch_decision(ON_DRA, DRA, "any") is ON_DRA


def test_claims_are_followed_on_dra_only_while_a_plugin_runs() -> None:
    assert claims_step(needed=True, following=False, dra_present=True, path=DRA) is (
        ClaimsStep.FOLLOW
    )
    assert claims_step(needed=False, following=True, dra_present=True, path=DRA) is (
        ClaimsStep.STOP
    )
    # a device-plugin node follows them from its start and never stops
    assert claims_step(needed=False, following=True, dra_present=True, path=DEVICE_PLUGINS) is (
        ClaimsStep.NONE
    )
    # nothing to follow without DRA, nothing twice
    assert claims_step(needed=True, following=False, dra_present=False, path=DRA) is (
        ClaimsStep.NONE
    )
    assert claims_step(needed=True, following=True, dra_present=True, path=DRA) is (ClaimsStep.NONE)
