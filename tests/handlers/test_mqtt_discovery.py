"""The mqtt handler against a real mosquitto broker (started per test on a free port): our
JSON announcements and Home Assistant discovery configs, removal by an empty retained
message, availability, garbage, the device cap, credentials, a broker restart, and an agent
turning announcements into Instances."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery_handlers.base import Device, report_problems_to
from discovery_handlers.mqtt import MqttHandler
from discovery_handlers.mqtt.handler import BrokerUnavailableError
from tests.harness.agent_process import AgentProcess, instance_files, poll_until

MOSQUITTO = shutil.which("mosquitto") or (
    "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
)
pytestmark = pytest.mark.skipif(
    MOSQUITTO is None, reason="mosquitto is not installed (apt-get install mosquitto; .ci/run does)"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Broker:
    directory: Path
    port: int
    users: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    tls: tuple[Path, Path, Path] | None = None  # CA, server certificate, server key

    def start(self) -> None:
        lines = [
            f"listener {self.port} 127.0.0.1",
            "persistence true",
            f"persistence_location {self.directory}/",
            f"allow_anonymous {'false' if self.users else 'true'}",
        ]
        if self.tls is not None:
            ca, cert, key = self.tls
            lines += [f"cafile {ca}", f"certfile {cert}", f"keyfile {key}"]
        if os.geteuid() == 0:
            # as root, mosquitto would switch to its own user, which cannot read this test's
            # password file or write its persistence file
            lines.append("user root")
        if self.users:
            passwords = self.directory / "passwords"
            passwords.write_text("")
            passwords.chmod(0o600)
            for user, password in self.users.items():
                subprocess.run(
                    ["mosquitto_passwd", "-b", str(passwords), user, password], check=True
                )
            lines.append(f"password_file {passwords}")
        config = self.directory / "mosquitto.conf"
        config.write_text("\n".join(lines) + "\n")
        assert MOSQUITTO is not None
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(self.directory / "broker.log").open("ab"),
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError((self.directory / "broker.log").read_text())
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port(), {})
    b.start()
    yield b
    b.stop()


async def publish(
    broker: Broker, topic: str, payload: bytes | str, *, user: tuple[str, str] | None = None
) -> None:
    import ssl

    import aiomqtt

    username, password = user if user else (None, None)
    context = ssl.create_default_context(cafile=str(broker.tls[0])) if broker.tls else None
    async with aiomqtt.Client(
        "127.0.0.1", broker.port, username=username, password=password, tls_context=context
    ) as client:
        await client.publish(topic, payload, qos=1, retain=True)


def details(mqtt: Broker, topics: list[str], **extra: object) -> str:
    text = {"broker": {"host": "127.0.0.1", "port": mqtt.port}, "topics": topics, **extra}
    return json.dumps(text)  # JSON is YAML


class Follower:
    """Consumes ``discover()`` in the background, keeping the latest list."""

    def __init__(self, stream: AsyncIterator[list[Device]]) -> None:
        self.lists: list[list[Device]] = []
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream: AsyncIterator[list[Device]]) -> None:
        try:
            async for devices in stream:
                self.lists.append(devices)
        except Exception as error:
            self.error = error

    def ids(self) -> set[str]:
        return {d.id for d in self.lists[-1]} if self.lists else set()

    def device(self, device_id: str) -> Device:
        return next(d for d in self.lists[-1] if d.id == device_id)

    async def until(self, check: object, what: str, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not check():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {within}s: {what}; lists: {self.lists[-3:]}")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_retained_announcements_make_the_first_list(broker: Broker) -> None:
    for index in range(3):
        body = {"id": f"sensor-{index}", "properties": {"room": "lab", "floor": 2}}
        await publish(broker, f"akri/devices/{index}", json.dumps(body))
    follower = Follower(MqttHandler().discover(details(broker, ["akri/devices/#"]), {}))
    try:
        await follower.until(lambda: follower.lists, "a first list")
        # the first list already holds every retained device (it waited for them)
        assert {d.id for d in follower.lists[0]} == {"sensor-0", "sensor-1", "sensor-2"}
        props = follower.device("sensor-1").properties
        assert props == {"MQTT_ROOM": "lab", "MQTT_FLOOR": "2", "MQTT_TOPIC": "akri/devices/1"}
        await publish(broker, "akri/devices/1", b"")  # an empty retained message removes it
        await follower.until(lambda: follower.ids() == {"sensor-0", "sensor-2"}, "sensor-1 gone")
        await publish(broker, "akri/devices/9", json.dumps({"id": "sensor-9"}))
        await follower.until(lambda: "sensor-9" in follower.ids(), "sensor-9 announced live")
    finally:
        await follower.close()


async def test_home_assistant_discovery_and_availability(broker: Broker) -> None:
    config = {
        "~": "home/plug1",
        "name": "Plug",
        "uniq_id": "plug1-switch",
        "stat_t": "~/state",
        "cmd_t": "~/set",
        "avty_t": "~/status",
        "dev": {"ids": ["0xabc", "plug1"], "mf": "Acme", "mdl": "P-1", "name": "Plug One"},
    }
    await publish(broker, "homeassistant/switch/plug1/relay/config", json.dumps(config))
    await publish(broker, "home/plug1/status", "online")
    follower = Follower(MqttHandler().discover(details(broker, ["homeassistant/#"]), {}))
    try:
        await follower.until(lambda: follower.ids() == {"plug1-switch"}, "the plug")
        props = follower.device("plug1-switch").properties
        assert props["MQTT_STATE_TOPIC"] == "home/plug1/state"
        assert props["MQTT_COMMAND_TOPIC"] == "home/plug1/set"
        assert props["MQTT_DEVICE_IDENTIFIERS"] == "0xabc,plug1"
        assert props["MQTT_DEVICE_MANUFACTURER"] == "Acme" and props["MQTT_DEVICE_MODEL"] == "P-1"
        assert props["MQTT_HA_COMPONENT"] == "switch" and props["MQTT_HA_NODE_ID"] == "plug1"
        await publish(broker, "home/plug1/status", "offline")
        await follower.until(lambda: follower.ids() == set(), "offline plug left the list")
        await publish(broker, "home/plug1/status", "online")
        await follower.until(lambda: follower.ids() == {"plug1-switch"}, "back online")
    finally:
        await follower.close()


async def test_garbage_is_skipped_and_the_cap_holds(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await publish(broker, "akri/devices/ok", json.dumps({"id": "ok"}))
    await publish(broker, "akri/devices/notjson", "{oops")
    await publish(broker, "akri/devices/binary", b"\xff\xfe\x00")
    await publish(broker, "akri/devices/huge", json.dumps({"id": "huge", "x": "y" * 70_000}))
    await publish(broker, "akri/devices/badid", json.dumps({"id": "a\nb"}))
    await publish(broker, "akri/devices/odd topic/ü", json.dumps({"id": "odd-topic"}))
    events: list[tuple[str, str]] = []

    async def record(reason: str, message: str) -> None:
        events.append((reason, message))

    report_problems_to(record)  # as the agent does for the task that runs discover()
    follower = Follower(
        MqttHandler().discover(details(broker, ["akri/devices/#"], maxDevices=2), {})
    )
    try:
        await follower.until(lambda: follower.lists, "a first list")
        assert follower.ids() == {"ok", "odd-topic"}
        await publish(broker, "akri/devices/third", json.dumps({"id": "third"}))
        # the cap: a log line and one Event
        await follower.until(lambda: events, "a DeviceCapReached Event")
        await publish(broker, "akri/devices/fourth", json.dumps({"id": "fourth"}))
        await asyncio.sleep(0.5)  # give the refused devices time to show up wrongly
        assert follower.ids() == {"ok", "odd-topic"} and follower.error is None
        (event,) = events  # the fourth device is refused without a second Event
        assert event[0] == "DeviceCapReached" and "maxDevices (2)" in event[1]
        assert any("maxDevices (2)" in r.getMessage() for r in caplog.records)
        assert any("refused" in r.getMessage() for r in caplog.records)  # the garbage
        assert follower.device("odd-topic").properties["MQTT_TOPIC"] == "akri/devices/odd topic/ü"
    finally:
        await follower.close()


async def test_credentials_from_discovery_properties(tmp_path: Path) -> None:
    broker = Broker(tmp_path, free_port(), {"akri": "s3cret"})
    broker.start()
    try:
        await publish(broker, "akri/devices/1", json.dumps({"id": "one"}), user=("akri", "s3cret"))
        handler = MqttHandler()
        good = {"username": b"akri", "password": b"s3cret"}
        follower = Follower(handler.discover(details(broker, ["akri/devices/#"]), good))
        try:
            await follower.until(lambda: follower.ids() == {"one"}, "the device, logged in")
        finally:
            await follower.close()
        bad = {"username": b"akri", "password": b"wrong"}
        with pytest.raises(BrokerUnavailableError) as refused:
            async for _ in handler.discover(details(broker, ["akri/devices/#"]), bad):
                pass
        assert "wrong" not in str(refused.value) and "s3cret" not in str(refused.value)
    finally:
        broker.stop()


async def test_a_broker_restart_ends_the_stream_and_a_new_one_recovers(broker: Broker) -> None:
    await publish(broker, "akri/devices/1", json.dumps({"id": "one"}))
    handler = MqttHandler()
    text = details(broker, ["akri/devices/#"])
    follower = Follower(handler.discover(text, {}))
    try:
        await follower.until(lambda: follower.ids() == {"one"}, "the device")
        broker.stop()
        # an error, not an empty list: the agent keeps the last list and calls again
        await follower.until(lambda: follower.error is not None, "the stream ended")
        assert isinstance(follower.error, BrokerUnavailableError)
        assert all(devices for devices in follower.lists)
        broker.start()  # persistence keeps the retained announcement
        again = Follower(handler.discover(text, {}))
        try:
            await again.until(lambda: again.ids() == {"one"}, "back after the restart")
        finally:
            await again.close()
    finally:
        await follower.close()


def test_an_agent_makes_instances_from_announcements(broker: Broker, tmp_path: Path) -> None:
    asyncio.run(
        publish(
            broker, "akri/devices/a", json.dumps({"id": "sensor-a", "properties": {"kind": "t"}})
        )
    )
    config = tmp_path / "mqtt.yaml"
    config.write_text(
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: sensors}\nspec:\n"
        "  discoveryHandler:\n    name: mqtt\n    discoveryDetails: |\n"
        f"      broker: {{host: 127.0.0.1, port: {broker.port}}}\n"
        "      topics: ['akri/devices/#']\n  capacity: 1\n"
    )
    state = tmp_path / "state"
    agent = AgentProcess(
        ["--local", "--no-debug-echo", "--state-dir", str(state), "--config", str(config),
         "--node-name", "n1", "--discovery-handlers-dir", str(tmp_path / "dh"),
         "--shared-offline-grace", "0"],
        label="agent (mqtt)",
    )  # fmt: skip
    try:
        found = poll_until(
            lambda: [i for i in instance_files(state).values()
                     if i["spec"]["brokerProperties"].get("MQTT_KIND") == "t"],
            timeout=15,
            message=agent.describe,
        )  # fmt: skip
        assert found[0]["spec"]["shared"] is True
        asyncio.run(publish(broker, "akri/devices/a", b""))
        poll_until(lambda: instance_files(state) == {}, timeout=15, message=agent.describe)
        assert agent.stop() == 0
    finally:
        agent.cleanup()


def test_an_agent_keeps_instances_while_the_broker_is_down_and_recovers(
    broker: Broker, tmp_path: Path
) -> None:
    """mosquitto stopped under a running agent: the handler fails (it does not report an
    empty list), so the Instance stays, not even marked offline, although the offline grace
    is 0 here (an outage taken for "no devices" would delete it at once). When the broker is
    back the handler reconnects and new announcements become Instances again."""
    asyncio.run(publish(broker, "akri/devices/a", json.dumps({"id": "sensor-a"})))
    config = tmp_path / "mqtt.yaml"
    config.write_text(
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: sensors}\nspec:\n"
        "  discoveryHandler:\n    name: mqtt\n    discoveryDetails: |\n"
        f"      broker: {{host: 127.0.0.1, port: {broker.port}}}\n"
        "      topics: ['akri/devices/#']\n  capacity: 1\n"
    )
    state = tmp_path / "state"
    agent = AgentProcess(
        ["--local", "--no-debug-echo", "--state-dir", str(state), "--config", str(config),
         "--node-name", "n1", "--discovery-handlers-dir", str(tmp_path / "dh"),
         "--shared-offline-grace", "0"],
        label="agent (mqtt outage)",
    )  # fmt: skip

    def instance_ids() -> dict[str, str]:
        return {
            name: instance["spec"]["brokerProperties"].get("MQTT_TOPIC", "")
            for name, instance in instance_files(state).items()
        }

    def marked_offline() -> list[str]:
        return [
            name
            for name, instance in instance_files(state).items()
            if "akri.sh/offline" in (instance["metadata"].get("annotations") or {})
        ]

    try:
        (first,) = poll_until(instance_ids, timeout=15, message=agent.describe)
        outage = agent.mark()
        broker.stop()
        failed = r"handler mqtt failed: BrokerUnavailableError"
        agent.wait_for_log(failed, timeout=15, since=outage)
        # and a reconnect attempt during the outage failed too (backoff 1 s, then 2 s)
        retried = len(agent.matching(failed, since=outage))
        poll_until(
            lambda: len(agent.matching(failed, since=outage)) > retried,
            timeout=15,
            message=agent.describe,
        )
        assert list(instance_ids()) == [first], agent.describe()
        assert marked_offline() == [], agent.describe()
        back = agent.mark()
        broker.start()  # persistence keeps the retained announcement
        agent.wait_for_log(r"mqtt: connected to 127\.0\.0\.1", timeout=30, since=back)
        agent.wait_for_log(r"mqtt reports 1 device", timeout=15, since=back)
        asyncio.run(publish(broker, "akri/devices/b", json.dumps({"id": "sensor-b"})))
        poll_until(
            lambda: sorted(instance_ids().values()) == ["akri/devices/a", "akri/devices/b"],
            timeout=15,
            message=agent.describe,
        )
        assert first in instance_ids() and marked_offline() == []
        assert agent.stop() == 0
    finally:
        agent.cleanup()


async def test_tls_with_a_test_ca(tmp_path: Path) -> None:
    from tests.core.kube.test_kubeconfig import make_certs

    certs = make_certs(tmp_path / "certs")
    broker = Broker(tmp_path, free_port(), {}, tls=(certs.ca, certs.server_cert, certs.server_key))
    broker.start()
    try:
        await publish(broker, "akri/devices/1", json.dumps({"id": "one"}))
        handler = MqttHandler()
        trusted = details(
            broker,
            ["akri/devices/#"],
            broker={"host": "127.0.0.1", "port": broker.port, "tls": {"caFile": str(certs.ca)}},
        )
        follower = Follower(handler.discover(trusted, {}))
        try:
            await follower.until(lambda: follower.ids() == {"one"}, "the device over TLS")
        finally:
            await follower.close()
        # a CA that did not sign the broker's certificate: refused, clearly
        untrusted = details(
            broker,
            ["akri/devices/#"],
            broker={
                "host": "127.0.0.1",
                "port": broker.port,
                "tls": {"caFile": str(certs.other_ca)},
            },
        )
        with pytest.raises(BrokerUnavailableError, match=r"127\.0\.0\.1"):
            async for _ in handler.discover(untrusted, {}):
                pass
    finally:
        broker.stop()


async def test_a_wrong_password_gives_a_clear_error_and_an_event(tmp_path: Path) -> None:
    from tests.doubles.apiserver import ApiServerDouble
    from tests.harness.dp_nodes import start_dp_node
    from tests.harness.k8s_nodes import CRDS, eventually

    broker = Broker(tmp_path / "b", free_port(), {"akri": "right-password"})
    broker.directory.mkdir()
    broker.start()
    secret = "wr0ng-pa55"
    configuration = {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": "sensors", "namespace": "default"},
        "spec": {
            "discoveryHandler": {
                "name": "mqtt",
                "discoveryDetails": details(broker, ["akri/devices/#"]),
                "discoveryProperties": [
                    {"name": "username", "value": "akri"},
                    {"name": "password", "value": secret},
                ],
            },
            "capacity": 1,
        },
    }
    try:
        async with ApiServerDouble(crds=CRDS) as api:
            api.create(configuration)
            node = await start_dp_node(api, "node-a", tmp_path)  # the agent's own handlers
            try:

                def failed() -> list[dict[str, object]]:
                    return [
                        e
                        for e in api.list("events")
                        if e["involvedObject"].get("name") == "sensors"
                        and e["reason"] == "DiscoveryFailed"
                    ]

                await eventually(lambda: bool(failed()), what="a DiscoveryFailed Event", within=15)
                message = str(failed()[0]["message"])
                assert f"127.0.0.1:{broker.port}" in message and "BrokerUnavailableError" in message
                assert secret not in message
            finally:
                await node.stop()
    finally:
        broker.stop()
