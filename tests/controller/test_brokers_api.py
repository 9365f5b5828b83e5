"""Broker Pods, Jobs and Services made by a running controller against the API-server double."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.naming import SLOTS_FINALIZER
from tests.controller.conftest import (
    add_node,
    broker_pod_spec,
    broker_pods,
    configuration,
    eventually,
    instance,
    more_passes,
    running_controller,
    set_phase,
)
from tests.doubles.apiserver import ApiServerDouble


async def test_one_pinned_broker_pod_per_node_with_akri_names(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(pod_spec=broker_pod_spec()))
    created = instance(api, "cams-8120fe", ["node-a", "node-b"])
    async with running_controller(api, tmp_path):
        pods = await eventually(
            lambda: len(broker_pods(api)) == 2 and broker_pods(api), "two broker pods"
        )
    assert [p["metadata"]["name"] for p in pods] == [
        "node-a-cams-8120fe-pod",
        "node-b-cams-8120fe-pod",
    ]
    for pod, target in zip(pods, ("node-a", "node-b"), strict=True):
        labels = pod["metadata"]["labels"]
        assert labels["controller"] == "akri.sh"
        assert labels["akri.sh/configuration"] == "cams"
        assert labels["akri.sh/instance"] == "cams-8120fe"
        assert labels["akri.sh/target-node"] == target
        assert labels["app"] == pod["metadata"]["name"]
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "Instance",
            "cams-8120fe",
            created["metadata"]["uid"],
            True,
        )
        term = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "In", "values": [target]}
        ]
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"akri.sh/cams-8120fe": "1"}


async def test_no_more_broker_pods_than_free_slots(api: ApiServerDouble, tmp_path: Path) -> None:
    for name in ("node-a", "node-b", "node-c"):
        add_node(api, name)
    api.create(configuration(pod_spec=broker_pod_spec()))
    # capacity 2, one slot already held by an application pod on node-c
    instance(
        api,
        "cams-8120fe",
        ["node-a", "node-b", "node-c"],
        usage={"cams-8120fe-0": "node-c"},
    )
    async with running_controller(api, tmp_path) as running:
        await eventually(lambda: len(broker_pods(api)) == 1, "one broker pod")
        # the pass that created it already saw the budget used up: no second pod, ever
        await more_passes(running.controller.reconciler, 2)
        assert len(broker_pods(api)) == 1
        assert running.controller.reconciler.stats.brokers_waiting == {"cams": 2}
        event = await eventually(
            lambda: [e for e in api.list("events") if e.get("reason") == "BrokerWaitingForSlot"],
            "an Event on the Configuration",
        )
        assert event[0]["involvedObject"]["name"] == "cams"
        assert "2 broker(s) not started" in event[0]["message"]


async def test_failed_broker_pod_is_replaced(api: ApiServerDouble, tmp_path: Path) -> None:
    add_node(api, "node-a")
    api.create(configuration(pod_spec=broker_pod_spec()))
    instance(api, "cams-8120fe", ["node-a"], shared=False)
    async with running_controller(api, tmp_path):
        first = await eventually(lambda: broker_pods(api), "a broker pod")
        assert first[0]["metadata"]["name"] == "cams-8120fe-pod"
        uid = first[0]["metadata"]["uid"]
        set_phase(api, "cams-8120fe-pod", "Failed")
        replaced = await eventually(
            lambda: [p for p in broker_pods(api) if p["metadata"]["uid"] != uid],
            "a replacement pod",
        )
        assert replaced[0]["metadata"]["name"] == "cams-8120fe-pod"


async def test_pod_removed_when_its_node_leaves_the_instance(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(pod_spec=broker_pod_spec()))
    instance(api, "cams-8120fe", ["node-a", "node-b"])
    async with running_controller(api, tmp_path):
        await eventually(lambda: len(broker_pods(api)) == 2, "two broker pods")
        current = api.get("instances.akri.sh", "cams-8120fe")
        assert current is not None
        current["spec"]["nodes"] = ["node-a"]
        api.apply(current)
        await eventually(
            lambda: [p["metadata"]["name"] for p in broker_pods(api)] == ["node-a-cams-8120fe-pod"],
            "node-b's broker removed",
        )
        api.delete("instances.akri.sh", "cams-8120fe")
        await eventually(lambda: not broker_pods(api), "brokers of a deleted Instance removed")


async def test_configuration_edit_rolls_brokers_over_new_before_old(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    config = api.create(configuration(pod_spec=broker_pod_spec("example/broker:1")))
    instance(api, "cams-8120fe", ["node-a"], capacity=2)
    async with running_controller(api, tmp_path):
        old = (await eventually(lambda: broker_pods(api), "first broker"))[0]
        set_phase(api, old["metadata"]["name"], "Running")
        # the running broker holds one slot of two: a second one fits
        current = api.get("instances.akri.sh", "cams-8120fe")
        assert current is not None
        current["spec"]["deviceUsage"]["cams-8120fe-0"] = "node-a"
        api.apply(current)
        config["spec"]["brokerSpec"]["brokerPodSpec"] = broker_pod_spec("example/broker:2")
        api.apply(config)
        both = await eventually(lambda: len(broker_pods(api)) == 2 and broker_pods(api), "surge")
        new = next(p for p in both if p["metadata"]["uid"] != old["metadata"]["uid"])
        assert new["spec"]["containers"][0]["image"] == "example/broker:2"
        assert re.fullmatch(r"node-a-cams-8120fe-[0-9a-f]{5}-pod", new["metadata"]["name"])
        # the old broker stays until the new one runs
        assert api.get("pods", old["metadata"]["name"]) is not None
        set_phase(api, new["metadata"]["name"], "Running")
        await eventually(
            lambda: [p["metadata"]["uid"] for p in broker_pods(api)] == [new["metadata"]["uid"]],
            "old broker removed after the new one runs",
        )


async def test_configuration_edit_without_a_free_slot_removes_the_old_broker_first(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    config = api.create(configuration(capacity=1, pod_spec=broker_pod_spec("example/broker:1")))
    instance(api, "cams-8120fe", ["node-a"], capacity=1)
    async with running_controller(api, tmp_path):
        old = (await eventually(lambda: broker_pods(api), "first broker"))[0]
        set_phase(api, old["metadata"]["name"], "Running")
        current = api.get("instances.akri.sh", "cams-8120fe")
        assert current is not None
        current["spec"]["deviceUsage"]["cams-8120fe-0"] = "node-a"
        api.apply(current)
        config["spec"]["brokerSpec"]["brokerPodSpec"] = broker_pod_spec("example/broker:2")
        api.apply(config)
        await eventually(lambda: not broker_pods(api), "old broker removed to make room")
        # the agent frees the slot once the old container is gone: then the new one comes
        current = api.get("instances.akri.sh", "cams-8120fe")
        assert current is not None
        current["spec"]["deviceUsage"]["cams-8120fe-0"] = ""
        api.apply(current)
        new = (await eventually(lambda: broker_pods(api), "new broker"))[0]
        assert new["spec"]["containers"][0]["image"] == "example/broker:2"


async def test_one_job_per_instance_per_generation(api: ApiServerDouble, tmp_path: Path) -> None:
    add_node(api, "node-a")
    job_spec = {
        "backoffLimit": 2,
        "template": {
            "spec": {
                "restartPolicy": "OnFailure",
                "containers": [
                    {
                        "name": "job",
                        "image": "example/job:1",
                        "resources": {"limits": {"{{PLACEHOLDER}}": "1"}},
                    }
                ],
            }
        },
    }
    config = api.create(configuration(job_spec=job_spec))
    instance(api, "cams-8120fe", ["node-a"])
    generation = config["metadata"]["generation"]
    async with running_controller(api, tmp_path):
        first = f"cams-8120fe-{generation}-job"
        await eventually(lambda: api.get("jobs.batch", first), "first job")
        job = api.get("jobs.batch", first)
        assert job is not None
        template = job["spec"]["template"]
        assert template["metadata"]["labels"]["akri.sh/instance"] == "cams-8120fe"
        limits = template["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"akri.sh/cams-8120fe": "1"}
        assert job["metadata"]["ownerReferences"][0]["name"] == "cams-8120fe"
        config = api.get("configurations.akri.sh", "cams") or {}
        config["spec"]["brokerSpec"]["brokerJobSpec"]["backoffLimit"] = 3
        updated = api.apply(config)
        assert updated["metadata"]["generation"] == generation + 1
        second = f"cams-8120fe-{generation + 1}-job"
        await eventually(lambda: api.get("jobs.batch", second), "second generation's job")
        assert api.get("jobs.batch", first) is not None  # left to finish
        assert len(api.list("jobs.batch")) == 2


async def test_services_follow_running_brokers(api: ApiServerDouble, tmp_path: Path) -> None:
    add_node(api, "node-a")
    ports = {"type": "ClusterIP", "ports": [{"name": "grpc", "port": 80, "targetPort": 8083}]}
    config = api.create(
        configuration(
            pod_spec=broker_pod_spec(), instance_service=ports, configuration_service=ports
        )
    )
    instance(api, "cams-8120fe", ["node-a"], shared=False)
    async with running_controller(api, tmp_path):
        pod = (await eventually(lambda: broker_pods(api), "broker"))[0]
        assert api.list("services") == []  # Pending: no Service yet
        set_phase(api, pod["metadata"]["name"], "Running")
        await eventually(lambda: len(api.list("services")) == 2, "two services")
        instance_svc = api.get("services", "cams-8120fe-svc")
        config_svc = api.get("services", "cams-svc")
        assert instance_svc is not None and config_svc is not None
        assert instance_svc["spec"]["selector"] == {
            "controller": "akri.sh",
            "akri.sh/instance": "cams-8120fe",
        }
        assert instance_svc["spec"]["ports"] == ports["ports"]
        assert instance_svc["metadata"]["ownerReferences"][0]["kind"] == "Instance"
        assert config_svc["spec"]["selector"] == {
            "controller": "akri.sh",
            "akri.sh/configuration": "cams",
        }
        owner = config_svc["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("Configuration", config["metadata"]["uid"])
        # a spec edit is applied to the stored Services
        config = api.get("configurations.akri.sh", "cams") or {}
        config["spec"]["instanceServiceSpec"]["ports"][0]["port"] = 81
        api.apply(config)
        await eventually(
            lambda: (
                (api.get("services", "cams-8120fe-svc") or {})["spec"]["ports"][0]["port"] == 81
            ),
            "instance service updated",
        )
        # the broker stops running: both Services go
        set_phase(api, pod["metadata"]["name"], "Failed")
        await eventually(lambda: api.list("services") == [], "services removed")


async def test_a_broker_job_s_pods_are_left_to_their_job_and_count_for_services(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    ports = {"ports": [{"port": 80}]}
    job_spec = {"template": {"spec": {"restartPolicy": "Never", **broker_pod_spec()}}}
    api.create(configuration(job_spec=job_spec, instance_service=ports))
    instance(api, "cams-8120fe", ["node-a"])
    async with running_controller(api, tmp_path):
        job = await eventually(lambda: api.get("jobs.batch", "cams-8120fe-1-job"), "job")
        # what the Job controller would start: a Pod from the template's labels
        labels = dict(job["spec"]["template"]["metadata"]["labels"])
        labels["batch.kubernetes.io/job-name"] = "cams-8120fe-1-job"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "cams-8120fe-1-job-x1", "namespace": "default", "labels": labels},
            "spec": job["spec"]["template"]["spec"],
        }
        api.create(pod)
        set_phase(api, "cams-8120fe-1-job-x1", "Running")
        await eventually(lambda: api.get("services", "cams-8120fe-svc"), "instance service")
        assert api.get("pods", "cams-8120fe-1-job-x1") is not None  # never taken for a stray


async def test_a_failing_pass_is_retried_and_the_leader_keeps_working(
    api: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.controller import brokers

    add_node(api, "node-a")
    api.create(configuration(pod_spec=broker_pod_spec()))
    original = brokers.plan_pods
    failures: list[int] = []

    def flaky(configuration: Any, instance: Any, *args: Any, **kwargs: Any) -> Any:
        # only this test's Instance: a controller of another test cannot take the failure
        if instance.name == "cams-f1a4e0" and not failures:
            failures.append(1)
            raise RuntimeError("a bug in a decision")
        return original(configuration, instance, *args, **kwargs)

    monkeypatch.setattr(brokers, "plan_pods", flaky)
    instance(api, "cams-f1a4e0", ["node-a"], shared=False)
    async with running_controller(api, tmp_path) as running:
        await eventually(lambda: broker_pods(api), "a broker after the failed pass", within=30)
        assert failures == [1]
        assert running.controller.reconciler.stats.pass_failures == 1


async def test_a_pass_over_many_instances_lets_the_event_loop_turn(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The health server and the watches run during a long pass (every YIELD_EVERY
    Instances), not only after it: counted with a task that runs whenever the loop turns."""
    import asyncio

    from agent.controller.reconcile import YIELD_EVERY
    from tests.controller.conftest import FakeClock, reconciler_for

    add_node(api, "node-a")
    api.create(configuration(capacity=1))  # no broker: a pass with nothing to write
    count = 3 * YIELD_EVERY + 1
    for index in range(count):
        instance(api, f"cams-{index:06x}", ["node-a"], capacity=1)
    async with reconciler_for(api, tmp_path, FakeClock()) as reconciler:
        await eventually(lambda: len(reconciler.store.list_cached()) == count, "cached")
        turns = 0
        running = True

        async def ticker() -> None:
            nonlocal turns
            while running:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker has started
        before = turns
        await reconciler._reconcile_brokers(  # the planning part of a pass, nothing to write
            {c.key: c for c in reconciler.store.configurations()},
            reconciler.store.list_cached(),
            0.0,
            [],
        )
        during = turns - before
        running = False
        await task
    assert during >= 3


async def test_brokers_of_a_terminating_instance_go_with_or_without_its_configuration(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 33.3: the README's uninstall deletes the Configurations; the garbage collector
    then deletes their Instances, which stay terminating on ``akri.sh/slots`` while their
    brokers hold slots — and owner GC removes the brokers only once the Instance is gone. The
    controller removes them (Pods, Jobs, and with them their Services)."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    ports = {"ports": [{"port": 80}]}
    api.create(configuration(pod_spec=broker_pod_spec(), instance_service=ports))
    job_spec = {"template": {"spec": {"restartPolicy": "Never", **broker_pod_spec()}}}
    api.create(configuration("jobs", job_spec=job_spec))
    finalizers = [SLOTS_FINALIZER]
    instance(api, "cams-8120fe", ["node-a", "node-b"], finalizers=finalizers)
    instance(api, "jobs-a19705", ["node-a"], configuration_name="jobs", finalizers=finalizers)
    instance(api, "cams-c0ffee", ["node-a"], shared=False, finalizers=finalizers)
    async with running_controller(api, tmp_path):
        pods = await eventually(lambda: len(broker_pods(api)) == 3 and broker_pods(api), "pods")
        for pod in pods:
            set_phase(api, pod["metadata"]["name"], "Running")
        await eventually(lambda: api.get("jobs.batch", "jobs-a19705-1-job"), "broker job")
        await eventually(lambda: len(api.list("services")) == 2, "instance services")
        # one Instance deleted while its Configuration stays: its broker goes, the others stay
        api.delete("instances.akri.sh", "cams-c0ffee")
        await eventually(lambda: not broker_pods(api, "cams-c0ffee"), "its broker removed")
        await eventually(lambda: len(api.list("services")) == 1, "its Service removed")
        assert len(broker_pods(api, "cams-8120fe")) == 2
        # the uninstall: Configurations deleted, their Instances terminating (finalizer)
        api.delete("configurations.akri.sh", "cams")
        api.delete("configurations.akri.sh", "jobs")
        for name in ("cams-8120fe", "jobs-a19705"):
            stored = api.get("instances.akri.sh", name)
            assert stored is not None and stored["metadata"]["deletionTimestamp"]
        await eventually(lambda: broker_pods(api) == [], "every broker pod removed")
        await eventually(lambda: api.list("jobs.batch") == [], "the broker job removed")
        await eventually(lambda: api.list("services") == [], "every Service removed")
    # the Instances wait on their slots' holders (the agents free them: tests/deploy)
    assert api.get("instances.akri.sh", "cams-8120fe") is not None


async def test_the_uninstall_deletes_each_service_once(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Acceptance F10: a real cluster's audit log showed a second DELETE of the Configuration's
    Service, answered 404, in every uninstall. The garbage collector deletes that Service with
    its Configuration, and the controller, whose watch of Services had not yet brought that
    DELETED event, deleted it too; an Instance's Service the controller deleted itself was
    sent again by a pass before the watch confirmed it. Here the controller's watch of
    Services lags for the whole test (held by the double), the widest form of both races:
    the Configuration's Service is left to the garbage collector, the Instance's (whose owner,
    terminating, remains) gets exactly one DELETE."""
    add_node(api, "node-a")
    ports = {"ports": [{"port": 80}]}
    api.create(
        configuration(
            pod_spec=broker_pod_spec(), instance_service=ports, configuration_service=ports
        )
    )
    instance(api, "cams-8120fe", ["node-a"], shared=False, finalizers=[SLOTS_FINALIZER])
    lagging = api.hang(verb="watch", resource="services")
    try:
        async with running_controller(api, tmp_path) as running:
            pod = (await eventually(lambda: broker_pods(api), "broker"))[0]
            set_phase(api, pod["metadata"]["name"], "Running")
            await eventually(lambda: len(api.list("services")) == 2, "two services")
            api.clear_requests()
            api.delete("configurations.akri.sh", "cams")  # the uninstall's first step
            assert api.get("services", "cams-svc") is None  # the garbage collector's
            await eventually(lambda: broker_pods(api) == [], "the broker removed")
            await eventually(lambda: api.list("services") == [], "every Service removed")
            await more_passes(running.controller.reconciler, 3)
            stats = running.controller.reconciler.stats
            assert sum(stats.services_deleted.values()) == 1
    finally:
        lagging.release()
    sent = {
        name: [r.status for r in api.requests_for("delete", "services", name)]
        for name in ("cams-svc", "cams-8120fe-svc")
    }
    assert sent == {"cams-svc": [], "cams-8120fe-svc": [200]}
