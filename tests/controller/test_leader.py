"""Leader election: two real ``akri controller`` processes against the API-server double —
one leads, the other takes over when the leader is killed, a clean stop hands the Lease over
at once — and the elector's Lease writes themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.controller.leader import LeaderElector, LeaseSettings
from agent.core.kube import make_kube_client
from tests.controller.conftest import (
    CRDS,
    FakeClock,
    add_node,
    broker_pod_spec,
    broker_pods,
    configuration,
    instance,
)
from tests.doubles.apiserver import ApiServerDouble, ThreadedApiServer
from tests.harness.agent_process import AgentProcess, describe_all, poll_until

WITHIN = 30.0
LEASE = ["--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.2"]


def _holder(api: ApiServerDouble) -> str:
    lease = api.get("leases.coordination.k8s.io", "akri-controller", "default") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def _start(api_url_kubeconfig: Path, identity: str, *extra: str) -> AgentProcess:
    return AgentProcess(
        [
            "--kubeconfig",
            str(api_url_kubeconfig),
            "--identity",
            identity,
            "--lease-namespace",
            "default",
            "--health-port",
            "0",
            *LEASE,
            *extra,
        ],
        command="controller",
        label=identity,
    )


def test_two_processes_one_leads_and_the_other_takes_over(tmp_path: Path) -> None:
    with ThreadedApiServer(crds=CRDS) as api:
        add_node(api, "node-a")
        api.create(configuration(pod_spec=broker_pod_spec()))
        instance(api, "cams-8120fe", ["node-a"], shared=False)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        first = _start(kubeconfig, "ctl-1")
        second = _start(kubeconfig, "ctl-2")
        processes = [first, second]
        try:
            leader_id = poll_until(
                lambda: _holder(api), timeout=WITHIN, message=lambda: describe_all(processes)
            )
            leader, standby = (first, second) if leader_id == "ctl-1" else (second, first)
            leader.wait_for_log("now leads", timeout=WITHIN)
            poll_until(lambda: broker_pods(api), timeout=WITHIN, message=leader.describe)
            standby.wait_for_log("ready; campaigning", timeout=WITHIN)
            assert not standby.matching("now leads"), describe_all(processes)
            # kill -9: no release; the standby waits out the lease duration, then leads
            leader.kill()
            api.delete("pods", "cams-8120fe-pod")
            poll_until(
                lambda: _holder(api) == standby.label,
                timeout=WITHIN,
                message=lambda: describe_all(processes),
            )
            standby.wait_for_log("now leads", timeout=WITHIN)
            # the new leader does the work: the deleted broker comes back
            poll_until(lambda: broker_pods(api), timeout=WITHIN, message=standby.describe)
            lease = api.get("leases.coordination.k8s.io", "akri-controller", "default") or {}
            assert lease["spec"]["leaseTransitions"] >= 1
            # a clean stop releases the Lease at once (holder cleared) and exits 0
            assert standby.stop(timeout=WITHIN) == 0
            assert _holder(api) == ""
            assert standby.matching("released the Lease"), standby.describe()
        finally:
            for process in processes:
                process.cleanup()


def test_a_released_lease_is_taken_by_the_next_process_at_once(tmp_path: Path) -> None:
    with ThreadedApiServer(crds=CRDS) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        first = _start(kubeconfig, "ctl-1")
        try:
            poll_until(lambda: _holder(api) == "ctl-1", timeout=WITHIN, message=first.describe)
            second = _start(kubeconfig, "ctl-2", "--log-format", "json")
            try:
                second.wait_for_log("ready; campaigning", timeout=WITHIN)
                assert first.stop(timeout=WITHIN) == 0
                # released: taken at the next attempt, not after a lease duration
                poll_until(
                    lambda: _holder(api) == "ctl-2",
                    timeout=WITHIN,
                    message=lambda: describe_all([first, second]),
                )
                second.wait_for_log("now leads", timeout=WITHIN)
                # the Deployment's --log-format json: one object per line
                entries = [json.loads(line) for line in second.lines if line.strip()]
                assert {"time", "level", "logger", "message"} <= entries[0].keys()
                assert any(e["logger"] == "agent.controller.leader" for e in entries)
            finally:
                second.cleanup()
        finally:
            first.cleanup()


async def test_elector_waits_a_whole_lease_duration_on_its_own_clock(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """A candidate never judges expiry by comparing renewTime with its wall clock: a Lease
    whose renewTime is long past is still respected for a lease duration after it was first
    seen unchanged."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.create(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "akri-controller", "namespace": "default"},
            "spec": {
                "holderIdentity": "other",
                "leaseDurationSeconds": 15,
                "renewTime": "2001-01-01T00:00:00.000000Z",
                "leaseTransitions": 4,
            },
        }
    )
    clock = FakeClock()
    client = make_kube_client(str(kubeconfig))
    elector = LeaderElector(
        client, LeaseSettings("default", "akri-controller", "me"), monotonic=clock
    )
    try:
        assert not await elector.try_acquire_or_renew()
        clock.advance(14.9)
        assert not await elector.try_acquire_or_renew()
        clock.advance(0.2)
        assert await elector.try_acquire_or_renew()
        lease: dict[str, Any] = api.get("leases.coordination.k8s.io", "akri-controller",
                                        "default") or {}  # fmt: skip
        assert lease["spec"]["holderIdentity"] == "me"
        assert lease["spec"]["leaseTransitions"] == 5
        # the other replica renewed meanwhile (a stale write of ours is refused: 409)
        lease["spec"]["holderIdentity"] = "other"
        api.apply(lease)
        assert not await elector.try_acquire_or_renew()
    finally:
        await client.close()


def test_lease_settings_are_checked() -> None:
    import argparse

    import pytest

    from agent.controller.settings import ControllerSettings, ControllerSettingsError, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--lease-duration", "5", "--renew-deadline", "6"])
    with pytest.raises(ControllerSettingsError, match="renew-deadline"):
        ControllerSettings.resolve(args, {})
    args = parser.parse_args([])
    settings = ControllerSettings.resolve(args, {"AKRI_NODE_GRACE": "120", "POD_NAME": "p-1"})
    assert (settings.node_grace, settings.identity) == (120.0, "p-1")
    with pytest.raises(ControllerSettingsError, match="AKRI_NODE_GRACE"):
        ControllerSettings.resolve(args, {"AKRI_NODE_GRACE": "soon"})


def test_exit_codes(tmp_path: Path) -> None:
    import socket

    from tests.harness.agent_process import AgentProcess as Process

    missing = Process(["--kubeconfig", str(tmp_path / "nope")], command="controller")
    try:
        assert missing.wait_exit(WITHIN) == 2, missing.describe()
        assert missing.matching("cannot configure the Kubernetes client"), missing.describe()
    finally:
        missing.cleanup()
    bad = Process(["--renew-deadline", "20"], command="controller")
    try:
        assert bad.wait_exit(WITHIN) == 2
        assert bad.matching("--renew-deadline must be shorter"), bad.describe()
    finally:
        bad.cleanup()
    with ThreadedApiServer(crds=CRDS) as api, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        busy = Process(
            ["--kubeconfig", str(kubeconfig), "--health-address", "127.0.0.1",
             "--health-port", str(taken.getsockname()[1])],
            command="controller",
        )  # fmt: skip
        try:
            assert busy.wait_exit(WITHIN) == 5, busy.describe()
        finally:
            busy.cleanup()


async def test_a_leader_that_cannot_renew_stops_leading_by_its_deadline(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The API server refuses every Lease write: the leader stops leading once the renew
    deadline has passed on its clock (before any standby could take over)."""
    import asyncio

    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    clock = FakeClock()
    client = make_kube_client(str(kubeconfig))
    settings = LeaseSettings("default", "akri-controller", "me", 3.0, 2.0, 0.05)
    elector = LeaderElector(client, settings, monotonic=clock)
    task = asyncio.create_task(elector.run())
    try:
        await asyncio.wait_for(elector.leading.wait(), WITHIN)
        api.fail(500, resource="leases.coordination.k8s.io", times=None)
        clock.advance(1.9)
        await asyncio.sleep(0.3)  # a few failed rounds, still inside the deadline
        assert elector.leading.is_set()
        clock.advance(0.2)
        deadline = asyncio.get_running_loop().time() + WITHIN
        while elector.leading.is_set():
            assert asyncio.get_running_loop().time() < deadline, "still leading"
            await asyncio.sleep(0.02)
        assert elector.transitions == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


def test_health_readiness_and_metrics_of_a_controller_process(tmp_path: Path) -> None:
    import socket
    import urllib.error
    import urllib.request

    def get(port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with ThreadedApiServer(crds=CRDS) as api:
        add_node(api, "node-a")
        api.create(configuration(pod_spec=broker_pod_spec()))
        instance(api, "cams-8120fe", ["node-a"], shared=False)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        process = _start(kubeconfig, "ctl-1", "--health-port", str(port),
                         "--health-address", "127.0.0.1")  # fmt: skip
        try:
            poll_until(lambda: get(port, "/healthz")[0] == 200, timeout=WITHIN,
                       message=process.describe)  # fmt: skip
            poll_until(lambda: get(port, "/readyz") == (200, "ready\n"), timeout=WITHIN,
                       message=process.describe)  # fmt: skip
            poll_until(lambda: broker_pods(api), timeout=WITHIN, message=process.describe)

            def scraped() -> str:
                status, text = get(port, "/metrics")
                counted = 'akri_broker_pod_count{configuration="cams",node="node-a"} 1.0'
                return text if status == 200 and counted in text else ""

            text = poll_until(scraped, timeout=WITHIN, message=process.describe)
            assert "akri_controller_leader 1.0" in text
            assert "akri_slot_writes_total" in text  # the process-wide metrics too
        finally:
            process.cleanup()
