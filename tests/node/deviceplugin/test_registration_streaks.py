"""Issue 36: a registration with kubelet that fails again and again is logged when the failures
start and when they end, not at every retry; every failure is counted
(``akri_kubelet_registration_failures_total``). Before, fifty agents started before their
kubelet logged about 9,300 warnings in five minutes (one per retry per resource)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.node.metrics import NodeCollector
from agent.ops.streaks import FailureStreak
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.deviceplugin.support import CL, Factory, il, instance, registered

STARTED = "failed ("
ENDED = "works again after"


def lines(caplog: pytest.LogCaptureFixture, text: str, level: int | None = None) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if text in r.getMessage() and (level is None or r.levelno == level)
    ]


def metric(collector: NodeCollector, plugin: str) -> float:
    for family in collector.collect():
        if family.name == "akri_kubelet_registration_failures":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("plugin") == plugin:
                    return sample.value
    raise AssertionError("akri_kubelet_registration_failures_total not exported")


def test_a_streak_is_logged_when_it_starts_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    streak = FailureStreak(
        logging.getLogger("test.streak"),
        "registering",
        "a_metric",
        noun="resource",
        clock=lambda: now[0],
    )
    with caplog.at_level(logging.DEBUG, logger="test.streak"):
        for _ in range(5):
            streak.failed("r1", "UNAVAILABLE: no socket")
            streak.failed("r2", "UNAVAILABLE: no socket")
        now[0] += 12.5
        streak.succeeded("r1")  # r2 still fails: the streak goes on
        streak.succeeded("r1")
        streak.failed("r2", "UNAVAILABLE: no socket")
        streak.succeeded("r2")
        streak.forget("r3")  # never failed: nothing to say
    assert streak.failures == 11
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "registering failed (r1: UNAVAILABLE: no socket); retrying with backoff. Further "
        "failures are not logged but counted (a_metric) until it works again"
    ]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "registering works again after 11 failed attempt(s) over 12.5s (2 resource(s); last: r2)"
    ]
    # a new streak is a new warning; a failing subject that is stopped ends it too
    with caplog.at_level(logging.INFO, logger="test.streak"):
        streak.failed("r1", "refused")
        streak.forget("r1")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert "is not tried any more after 1 failed attempt(s)" in caplog.records[-1].getMessage()


@pytest.fixture
async def no_kubelet(kubelet: KubeletDouble) -> AsyncIterator[KubeletDouble]:
    """The device-plugin directory without kubelet: its socket is not there yet."""
    await kubelet.stop()
    (kubelet.device_plugin_dir / "kubelet.sock").unlink(missing_ok=True)
    yield kubelet


async def test_device_plugins_without_kubelet_warn_once_then_say_when_it_works(
    store: MemoryStore,
    no_kubelet: KubeletDouble,
    make_manager: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kubelet = no_kubelet
    for i in range(2):
        store.put(instance(i))
    caplog.set_level(logging.INFO)
    manager = await make_manager()
    resources = [il(0), il(1), CL]
    # three plugins, each retrying with backoff: a dozen failures take a few seconds
    await eventually(lambda: manager.registration_failures >= 12, 60, "failures")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings  # before: one per retry of each plugin
    assert warnings[0].startswith("registering device plugins with kubelet failed (akri.sh/")

    await kubelet.start()  # kubelet is there: the manager sees its socket, all register
    await manager.check_sockets()
    await registered(kubelet, resources)
    await eventually(lambda: bool(lines(caplog, ENDED)), 30, "the end of the streak logged")
    assert len(lines(caplog, ENDED)) == 1
    assert "(3 resource(s);" in lines(caplog, ENDED)[0]
    assert len(lines(caplog, "registering device plugins with kubelet failed")) == 1
    failed = manager.registration_failures
    assert failed >= 12


# -- DRA ---------------------------------------------------------------------------------------


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_a_dra_driver_kubelet_refuses_is_logged_once_per_streak(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kubelet retries a refused DRA registration with backoff and notifies every refusal:
    one error line, the count in the metric, one line when it is accepted."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    assert node.dra is not None
    registration = node.dra.registration
    supported = registration.versions
    registration.versions = ["v0.DRAPlugin"]  # no version this kubelet knows: refused
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api, initial_backoff=0.05)
    caplog.set_level(logging.INFO)
    await kubelet.start()
    try:
        await eventually(lambda: node.dra is not None and node.dra.registration_failures >= 4, 30)
        refused = lines(caplog, "registering DRA driver akri.sh with kubelet failed")
        assert len(refused) == 1 and "none of the" in refused[0]
        assert metric(NodeCollector(node.agent), "dra") >= 4
        registration.versions = supported
        await kubelet.wait_for_registration("akri.sh", timeout=30)
        await eventually(lambda: bool(lines(caplog, ENDED)), 10, "end of the refusals")
        assert len(lines(caplog, "registering DRA driver akri.sh with kubelet failed")) == 1
        assert len(lines(caplog, "kubelet registered DRA driver akri.sh")) == 1
    finally:
        await kubelet.stop()
        await node.stop()
