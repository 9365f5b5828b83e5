"""Issue 40, items 2, 3 and 6: the chart takes Akri's values with Akri's meaning.

- Akri's own values.yaml (chart 0.13.26, a fixture) installs unchanged: every key is accepted;
- Akri's documented ``--set`` combinations (debugEcho, udev with udevRules, onvif, opcua with
  discoveryUrls, custom) render Configurations as Akri's chart does — checked object by object,
  against our CRD, with the handler's own validation of the discoveryDetails, and each broker
  spec as a strict Pod/Job/Service — and the discovery-handler DaemonSets with Akri's names;
- a misspelled or mistyped value fails with a message naming it (values.schema.json);
- every rendered object validates strictly against the Kubernetes schemas.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.node.app import build_handlers
from agent.node.settings import AGENT_OPTIONS, AgentSettings, resolve
from tests.deploy.helm_chart import CHART, Objects, helm, needs_helm, one, template, template_error
from tests.doubles.crd_pipeline import CONFIGURATION_CRD, load_crd, schema_errors, schema_of
from tests.paths import FIXTURES

AKRI_VALUES = FIXTURES / "akri-chart" / "values-0.13.26.yaml"
K8S_VERSION = "1.34"
PLACEHOLDER = "{{PLACEHOLDER}}"

pytestmark = needs_helm


def handlers() -> Any:
    class Args:
        pass

    values = resolve(Args(), AGENT_OPTIONS, {"AKRI_DEBUG_ECHO": "true"})  # type: ignore[arg-type]
    return build_handlers(AgentSettings.from_values(values))


def configuration(objects: Objects, name: str) -> dict[str, Any]:
    found = one(objects, "Configuration", name)
    errors = schema_errors(found, schema_of(load_crd(CONFIGURATION_CRD)))
    assert not errors, errors
    return found


def details(config: dict[str, Any]) -> Any:
    """The discoveryDetails as data, after the handler's own validation accepted them."""
    handler = config["spec"]["discoveryHandler"]
    found = handlers().get(handler["name"])
    if found is not None:
        warnings = found.validate(handler["discoveryDetails"])
        assert not warnings, warnings
    return yaml.safe_load(handler["discoveryDetails"])


def strict(kind: str, api_version: str, spec: dict[str, Any]) -> None:
    kubernetes_validate.validate(
        {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}, "spec": spec},
        K8S_VERSION,
        strict=True,
    )


def validate_all(objects: Objects) -> None:
    for obj in objects:
        if obj["kind"] in ("Configuration", "CustomResourceDefinition"):
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def daemonset(objects: Objects, name: str) -> dict[str, Any]:
    found = one(objects, "DaemonSet", name)
    assert found["metadata"]["labels"]["app.kubernetes.io/name"] == name
    assert found["metadata"]["labels"]["app.kubernetes.io/part-of"] == "akri"
    assert found["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name
    return found


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_akris_own_values_file_installs_unchanged() -> None:
    """``helm install -f <Akri's values.yaml>``: every key of it passes the schema, and it
    renders the agent and the controller (Akri's defaults enable nothing else)."""
    done = helm("template", "akri", str(CHART), "-n", "akri", "-f", str(AKRI_VALUES))
    assert done.returncode == 0, done.stderr
    objects = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert {o["metadata"]["name"] for o in objects if o["kind"] in ("DaemonSet", "Deployment")} == {
        "akri-agent",
        "akri-controller",
    }
    validate_all(objects)


def akri_keys(values: Any, prefix: str = "") -> list[str]:
    if not isinstance(values, dict):
        return [prefix]
    return [k for name, v in values.items() for k in akri_keys(v, f"{prefix}.{name}".strip("."))]


def test_every_akri_key_is_in_our_values_file() -> None:
    """Our values.yaml lists (and comments) every key of Akri's."""
    ours = set(akri_keys(yaml.safe_load((CHART / "values.yaml").read_text())))
    missing = [k for k in akri_keys(yaml.safe_load(AKRI_VALUES.read_text())) if k not in ours]
    # inside the maps that take any key (a securityContext, tolerations) ours may hold others
    free = (".securityContext.", ".tolerations")
    assert not [k for k in missing if not any(f in k for f in free)], missing


def test_debug_echo_as_akri_documents_it() -> None:
    """docs.akri.sh: --set agent.allowDebugEcho=true --set debugEcho.configuration.enabled=true
    --set debugEcho.discovery.enabled=true (--set debugEcho.configuration.shared=false)."""
    objects = template(
        "agent.allowDebugEcho=true",
        "debugEcho.configuration.enabled=true",
        "debugEcho.discovery.enabled=true",
        "debugEcho.configuration.shared=false",
    )
    validate_all(objects)
    config = configuration(objects, "akri-debug-echo")
    assert config["metadata"]["namespace"] == "akri"
    assert details(config) == {"descriptions": ["foo0", "foo1"]}
    assert config["spec"]["capacity"] == 2
    assert config["spec"]["brokerProperties"] == {}
    assert "brokerSpec" not in config["spec"] and "instanceServiceSpec" not in config["spec"]
    agent = one(objects, "DaemonSet", "akri-agent")["spec"]["template"]["spec"]["containers"][0]
    assert env(agent)["AKRI_DEBUG_ECHO"] == "true"
    assert env(agent)["AKRI_DEBUG_ECHO_SHARED"] == "false"
    handler_pod = daemonset(objects, "akri-debug-echo-discovery")["spec"]["template"]["spec"]
    (container,) = handler_pod["containers"]
    assert container["args"] == ["handler", "debugEcho"]
    assert container["image"] == agent["image"]
    assert env(container)["DEBUG_ECHO_INSTANCES_SHARED"] == "false"
    assert env(container)["DISCOVERY_HANDLERS_DIRECTORY"] == "/var/lib/akri"
    assert {"name": "discovery-handlers", "mountPath": "/var/lib/akri"} in container["volumeMounts"]
    # docs.akri.sh (debug echo): `kubectl exec <handler pod> -- /bin/sh -c "echo OFFLINE >
    # /tmp/debug-echo-availability.txt"` unplugs the devices: /tmp is writable on the
    # read-only root (on a real 1.36 cluster the write failed, "Read-only file system")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in handler_pod["volumes"]


def test_udev_with_rules_and_a_broker_as_akri_documents_it() -> None:
    """docs.akri.sh (udev video): udevRules[0], a broker image, Akri's services."""
    objects = template(
        "udev.discovery.enabled=true",
        "udev.configuration.enabled=true",
        "udev.configuration.name=akri-udev-video",
        'udev.configuration.discoveryDetails.udevRules[0]=KERNEL=="video[0-9]*"',
        "udev.configuration.brokerPod.image.repository=ghcr.io/project-akri/akri/udev-video-broker",
        "udev.configuration.brokerProperties.RESOLUTION_WIDTH=640",
        "udev.configuration.capacity=3",
    )
    validate_all(objects)
    config = configuration(objects, "akri-udev-video")
    assert details(config) == {
        "groupRecursive": False,
        "udevRules": ['KERNEL=="video[0-9]*"'],
        "permissions": "rwm",
    }
    spec = config["spec"]
    assert spec["capacity"] == 3
    assert spec["brokerProperties"] == {"RESOLUTION_WIDTH": "640"}
    pod = spec["brokerSpec"]["brokerPodSpec"]
    strict("Pod", "v1", pod)
    (broker,) = pod["containers"]
    assert broker["name"] == "akri-udev-video-broker"
    assert broker["image"] == "ghcr.io/project-akri/akri/udev-video-broker:latest"
    assert broker["securityContext"] == {"privileged": True}  # Akri's default for udev brokers
    assert broker["resources"]["limits"][PLACEHOLDER] == "1"
    assert broker["resources"]["requests"][PLACEHOLDER] == "1"
    for service in ("instanceServiceSpec", "configurationServiceSpec"):
        strict("Service", "v1", spec[service])
        assert spec[service]["ports"] == [
            {"name": "grpc", "port": 80, "protocol": "TCP", "targetPort": 8083}
        ]
    handler_pod = daemonset(objects, "akri-udev-discovery")["spec"]["template"]["spec"]
    assert handler_pod["hostNetwork"] is True  # udev's netlink events are the node's
    (container,) = handler_pod["containers"]
    assert container["args"] == ["handler", "udev"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {
        "/var/lib/akri",
        "/tmp",
        "/run/udev",
        "/sys",
    }


def test_onvif_with_filters_and_properties() -> None:
    objects = template(
        "onvif.discovery.enabled=true",
        "onvif.configuration.enabled=true",
        "onvif.configuration.discoveryDetails.ipAddresses.action=Include",
        "onvif.configuration.discoveryDetails.ipAddresses.items[0]=10.0.0.1",
        "onvif.configuration.discoveryDetails.discoveryTimeoutSeconds=2",
        "onvif.configuration.discoveryProperties[0].name=username",
        "onvif.configuration.discoveryProperties[0].valueFrom.secretKeyRef.name=onvif-auth",
        "onvif.configuration.discoveryProperties[0].valueFrom.secretKeyRef.key=username",
        "onvif.configuration.brokerPod.image.repository=ghcr.io/project-akri/akri/onvif-video-broker",
    )
    validate_all(objects)
    config = configuration(objects, "akri-onvif")
    assert details(config) == {
        "ipAddresses": {"action": "Include", "items": ["10.0.0.1"]},
        "macAddresses": {"action": "Exclude", "items": []},
        "scopes": {"action": "Exclude", "items": []},
        "uuids": {"action": "Exclude", "items": []},
        "discoveryTimeoutSeconds": 2,
    }
    assert config["spec"]["discoveryHandler"]["discoveryProperties"] == [
        {
            "name": "username",
            "valueFrom": {"secretKeyRef": {"name": "onvif-auth", "key": "username"}},
        }
    ]
    assert config["spec"]["instanceServiceSpec"]["ports"][0]["name"] == "grpc"
    assert daemonset(objects, "akri-onvif-discovery")["spec"]["template"]["spec"]["hostNetwork"]


def test_opcua_with_discovery_urls_and_certificates() -> None:
    objects = template(
        "opcua.discovery.enabled=true",
        "opcua.configuration.enabled=true",
        "opcua.configuration.name=akri-opcua-monitoring",
        "opcua.configuration.discoveryDetails.discoveryUrls[0]=opc.tcp://10.0.0.1:4840/",
        "opcua.configuration.discoveryDetails.discoveryUrls[1]=opc.tcp://10.0.0.2:4840/",
        "opcua.configuration.mountCertificates=true",
        "opcua.configuration.brokerPod.image.repository=ghcr.io/project-akri/akri/opcua-monitoring-broker",
        "opcua.configuration.brokerPod.env.IDENTIFIER=Thermometer_Temperature",
    )
    validate_all(objects)
    config = configuration(objects, "akri-opcua-monitoring")
    assert details(config) == {
        "opcuaDiscoveryMethod": {
            "standard": {"discoveryUrls": ["opc.tcp://10.0.0.1:4840/", "opc.tcp://10.0.0.2:4840/"]}
        },
        "applicationNames": {"action": "Exclude", "items": []},
    }
    pod = config["spec"]["brokerSpec"]["brokerPodSpec"]
    strict("Pod", "v1", pod)
    (broker,) = pod["containers"]
    assert broker["env"] == [{"name": "IDENTIFIER", "value": "Thermometer_Temperature"}]
    assert broker["volumeMounts"] == [
        {"name": "credentials", "mountPath": "/etc/opcua-certs/client-pki", "readOnly": False}
    ]
    assert pod["volumes"][0]["secret"]["secretName"] == "opcua-broker-credentials"
    assert config["spec"]["configurationServiceSpec"]["ports"][0]["name"] == "grpc"


def test_custom_configuration_and_discovery_handler() -> None:
    """docs.akri.sh (custom handler, e.g. http): discoveryHandlerName, a string of details, the
    handler's own image as a DaemonSet named as given."""
    objects = template(
        "custom.configuration.enabled=true",
        "custom.configuration.name=akri-http",
        "custom.configuration.discoveryHandlerName=http",
        "custom.configuration.discoveryDetails=http://device-registry:9999",
        "custom.discovery.enabled=true",
        "custom.discovery.name=akri-http-discovery",
        "custom.discovery.image.repository=ghcr.io/project-akri/akri/http-discovery",
        "custom.discovery.image.tag=v0.13.26",
        "custom.configuration.brokerJob.image.repository=busybox",
        "custom.configuration.brokerJob.command[0]=sh",
        "custom.configuration.brokerJob.command[1]=-c",
        "custom.configuration.brokerJob.command[2]=echo 'Hello World'",
        "custom.configuration.brokerJob.envFrom.secretRef[0]=my-secret",
        "custom.configuration.brokerJob.env.MODE=once",
        "imagePullSecrets[0].name=regcred",
    )
    validate_all(objects)
    config = configuration(objects, "akri-http")
    assert config["spec"]["discoveryHandler"]["name"] == "http"
    assert config["spec"]["discoveryHandler"]["discoveryDetails"] == "http://device-registry:9999"
    job = config["spec"]["brokerSpec"]["brokerJobSpec"]
    strict("Job", "batch/v1", job)
    assert (job["backoffLimit"], job["parallelism"], job["completions"]) == (2, 1, 1)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    (broker,) = pod["containers"]
    assert broker["command"] == ["sh", "-c", "echo 'Hello World'"]
    assert broker["envFrom"] == [{"secretRef": {"name": "my-secret"}}]
    assert broker["env"] == [{"name": "MODE", "value": "once"}]
    assert broker["resources"]["limits"][PLACEHOLDER] == "1"
    assert "instanceServiceSpec" not in config["spec"]  # Akri: Services only with a broker Pod
    handler_pod = daemonset(objects, "akri-http-discovery")["spec"]["template"]["spec"]
    (container,) = handler_pod["containers"]
    assert container["image"] == "ghcr.io/project-akri/akri/http-discovery:v0.13.26"
    assert "args" not in container  # its own command
    assert handler_pod["imagePullSecrets"] == [{"name": "regcred"}]
    for name in ("akri-agent", "akri-http-discovery"):
        assert one(objects, "DaemonSet", name)["spec"]["template"]["spec"]["imagePullSecrets"] == [
            {"name": "regcred"}
        ]


def test_full_agent_runs_no_handler_daemonsets() -> None:
    objects = template(
        "agent.full=true", "udev.discovery.enabled=true", "onvif.discovery.enabled=true"
    )
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "DaemonSet"] == ["akri-agent"]


def test_network_handlers_register_with_their_pod_ip() -> None:
    objects = template(
        "opcua.discovery.enabled=true",
        "opcua.discovery.useNetworkConnection=true",
        "opcua.discovery.port=10001",
        "agent.discoveryHandlerNetworks=10.244.0.0/16",
    )
    (container,) = one(objects, "DaemonSet", "akri-opcua-discovery")["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["args"] == ["handler", "opcua", "--port", "10001"]
    assert env(container)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert container["ports"] == [{"name": "discovery", "containerPort": 10001}]
    agent = one(objects, "DaemonSet", "akri-agent")["spec"]["template"]["spec"]["containers"][0]
    assert env(agent)["AKRI_DISCOVERY_HANDLER_NETWORKS"] == "10.244.0.0/16"


def test_kubelet_paths_of_microk8s_are_mounted_and_given() -> None:
    """agent.host.*: a kubelet root elsewhere (MicroK8s) is mounted at the node's path and
    given to the agent, so that the DRA socket it names to kubelet is kubelet's path."""
    root = "/var/snap/microk8s/common/var/lib/kubelet"
    objects = template(
        f"agent.host.kubeletDevicePlugins={root}/device-plugins",
        f"agent.host.kubeletPodResources={root}/pod-resources",
        f"agent.host.kubeletPluginsRegistry={root}/plugins_registry",
        f"agent.host.kubeletPlugins={root}/plugins",
    )
    validate_all(objects)
    pod = one(objects, "DaemonSet", "akri-agent")["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert env(agent) | {
        "AKRI_DEVICE_PLUGIN_DIR": f"{root}/device-plugins",
        "AKRI_POD_RESOURCES_SOCKET": f"{root}/pod-resources/kubelet.sock",
        "AKRI_PLUGINS_REGISTRY_DIR": f"{root}/plugins_registry",
        "AKRI_DRA_PLUGIN_DIR": f"{root}/plugins/akri.sh",
    } == env(agent)
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for name in ("device-plugins", "pod-resources", "plugins-registry", "plugins"):
        assert mounts[name] == paths[name] and paths[name].startswith(root)
    # and the agent reads those variables as the paths it uses
    values = resolve(type("Args", (), {})(), AGENT_OPTIONS, env(agent) | {"AKRI_NODE_NAME": "n"})  # type: ignore[arg-type]
    settings = AgentSettings.from_values(values)
    assert str(settings.dra_plugin_dir) == f"{root}/plugins/akri.sh"
    assert str(settings.pod_resources_socket) == f"{root}/pod-resources/kubelet.sock"


def test_our_keys() -> None:
    objects = template("agent.extendedResources=device-plugins", "controller.replicas=1")
    agent = one(objects, "DaemonSet", "akri-agent")["spec"]["template"]["spec"]["containers"][0]
    assert env(agent)["AKRI_EXTENDED_RESOURCES"] == "device-plugins"
    assert one(objects, "Deployment", "akri-controller")["spec"]["replicas"] == 1


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("debugEcho.configuraton.enabled=true", "'configuraton' not allowed"),
        ("debugEcho.configuration.capacity=two", "/debugEcho/configuration/capacity"),
        ("agent.allowDebugEcho=yes", "/agent/allowDebugEcho"),
        ("agent.extendedResources=both", "/agent/extendedResources"),
        ("udev.configuration.brokerJob.restartPolicy=Always", "restartPolicy"),
        ("controler.enabled=false", "'controler' not allowed"),
        ("crds.group=example.com", "/crds/group"),
    ],
)
def test_a_misspelled_or_mistyped_value_is_refused_by_name(value: str, named: str) -> None:
    """Akri's chart ignores these; ours fails ``helm install``/``upgrade``/``template``."""
    assert named in template_error(value)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (("udev.configuration.enabled=true",), "udevRules"),
        (("custom.configuration.enabled=true",), "discoveryHandlerName"),
        (("custom.discovery.enabled=true",), "custom.discovery.image.repository"),
    ],
)
def test_a_missing_required_value_says_which(values: tuple[str, ...], named: str) -> None:
    assert named in template_error(*values)


def test_the_controller_fills_the_placeholder_of_a_charted_broker() -> None:
    """A chart-rendered broker (Pod and Job) becomes what akri controller creates: the
    ``{{PLACEHOLDER}}`` slot request names the Instance's resource, as Akri's controller does."""
    from agent.controller import brokers
    from agent.core.model.configuration import parse_configuration
    from agent.core.model.instance import Instance

    rule = 'udev.configuration.discoveryDetails.udevRules[0]=KERNEL=="video[0-9]*"'
    instance = Instance(
        name="akri-udev-8120fe", configuration_name="akri-udev", capacity=1, nodes=("node-a",),
        device_usage={"akri-udev-8120fe-0": ""}, shared=False, uid="uid-1", namespace="akri",
    )  # fmt: skip
    for broker in ("brokerPod", "brokerJob"):
        objects = template(
            "udev.configuration.enabled=true", rule,
            f"udev.configuration.{broker}.image.repository=example/broker",
        )  # fmt: skip
        config = parse_configuration(configuration(objects, "akri-udev"))
        if broker == "brokerPod":
            made = brokers.broker_pod(config, instance, "node-a", "node-a-akri-udev-8120fe-pod")
            pod = made["spec"]
        else:
            pod = brokers.broker_job(config, instance)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        for amounts in (container["resources"]["limits"], container["resources"]["requests"]):
            assert PLACEHOLDER not in amounts
            assert amounts["akri.sh/akri-udev-8120fe"] == "1"


def test_one_image_runs_every_pod() -> None:
    """agent.image.* moves the agent, the controller, the handlers and the hook together;
    controller.image.* moves the controller alone."""
    objects = template(
        "agent.image.repository=registry.local/akri-agent", "agent.image.tag=1.2.3",
        "udev.discovery.enabled=true",
    )  # fmt: skip
    images = {
        c["image"]
        for o in objects
        if o["kind"] in ("DaemonSet", "Deployment", "Job")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"registry.local/akri-agent:1.2.3"}
    objects = template("controller.image.repository=other/controller", "controller.image.tag=9")
    (container,) = one(objects, "Deployment", "akri-controller")["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["image"] == "other/controller:9"


def kinds_and_names(objects: Objects) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_the_switches_akri_users_flip() -> None:
    """rbac.enabled, cleanupHook.enabled, agent/controller.enabled, placement keys."""
    everything = kinds_and_names(template())
    no_rbac = kinds_and_names(template("rbac.enabled=false"))
    rbac = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert {k for k, _ in everything - no_rbac} == rbac
    assert not {k for k, _ in no_rbac} & rbac
    assert ("Job", "akri-cleanup-hook") in everything
    no_hook = kinds_and_names(template("cleanupHook.enabled=false"))
    assert everything - no_hook == {
        ("Job", "akri-cleanup-hook"), ("ServiceAccount", "akri-cleanup-hook"),
        ("ClusterRole", "akri-cleanup-hook"), ("ClusterRoleBinding", "akri-cleanup-hook"),
        ("Role", "akri-cleanup-hook"), ("RoleBinding", "akri-cleanup-hook"),
    }  # fmt: skip
    no_agent = kinds_and_names(template("agent.enabled=false"))
    assert ("DaemonSet", "akri-agent") not in no_agent
    assert ("ClusterRole", "akri-agent") not in no_agent
    assert ("Deployment", "akri-controller") not in kinds_and_names(
        template("controller.enabled=false")
    )
    placed = template(
        "controller.onlyOnControlPlane=true",
        "controller.allowOnControlPlane=false",
        "controller.nodeSelectors.zone=edge",
        "agent.nodeSelectors.akri=yes",
        "agent.tolerations[0].key=dedicated",
        "agent.tolerations[0].operator=Exists",
    )
    validate_all(placed)
    controller = one(placed, "Deployment", "akri-controller")["spec"]["template"]["spec"]
    assert controller["nodeSelector"] == {
        "kubernetes.io/os": "linux", "node-role.kubernetes.io/control-plane": "", "zone": "edge",
    }  # fmt: skip
    assert "tolerations" not in controller
    agent = one(placed, "DaemonSet", "akri-agent")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"akri": "yes"}
    assert agent["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]


def hook_arguments(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]


@pytest.mark.parametrize(
    "values",
    [
        (),
        ("debugEcho.discovery.enabled=true", "udev.discovery.enabled=true"),
        ("agent.full=true", "udev.discovery.enabled=true"),
        ("agent.enabled=false", "controller.enabled=false", "opcua.discovery.enabled=true"),
        ("agent.enabled=false", "controller.enabled=false"),
    ],
)
def test_the_cleanup_hook_removes_the_workloads_the_chart_renders(values: tuple[str, ...]) -> None:
    """Issue 40.4: the hook deletes, by the chart's names, exactly the DaemonSets and the
    Deployment the release runs, then the controller's Lease (the one its RBAC names), and its
    Role may get and delete those and nothing else."""
    objects = template(*values)
    (container,) = one(objects, "Job", "akri-cleanup-hook")["spec"]["template"]["spec"][
        "containers"
    ]
    args = container["args"]
    daemonsets = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "DaemonSet")
    deployments = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Deployment")
    assert sorted(hook_arguments(args, "--daemonset")) == daemonsets
    assert sorted(hook_arguments(args, "--deployment")) == deployments
    assert hook_arguments(args, "--namespace") == ["akri"]
    roles = [
        o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "akri-cleanup-hook"
    ]
    if not daemonsets and not deployments:
        # nothing to name: no Role (a rule without names would grant every object of its kind)
        assert roles == []
        assert not {"--daemonset", "--deployment", "--lease"} & set(args)
        return
    rules = roles[0]["rules"]
    granted = {
        (rule["resources"][0], name): rule["verbs"]
        for rule in rules
        for name in rule["resourceNames"]
    }
    wanted = {("daemonsets", n): ["get", "delete"] for n in daemonsets}
    wanted |= {("deployments", n): ["get", "delete"] for n in deployments}
    if deployments:
        lease_role = one(objects, "Role", "akri-controller-lease")
        (lease,) = [n for r in lease_role["rules"] for n in r.get("resourceNames", [])]
        assert hook_arguments(args, "--lease") == [lease]
        wanted[("leases", lease)] = ["delete"]
    else:
        assert hook_arguments(args, "--lease") == []
    assert granted == wanted
    assert all(rule.get("resourceNames") for rule in rules)  # none without names: all of them
