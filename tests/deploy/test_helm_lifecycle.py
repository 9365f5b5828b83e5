"""Issue 40, items 4 and 6: ``helm install``, ``helm upgrade`` and ``helm uninstall`` of the
chart with a real Helm 4 against the API-server double, as an Akri user runs them (Akri's
documented debugEcho values), in a release namespace of their choosing.

No kubelet or controllers run here, so the test stands in for them where Helm waits on them:
it starts the agent the DaemonSet describes (its container's arguments and environment), and
for the uninstall hook it does what the Job controller and kubelet would — runs the Job's
command, ``akri uninstall-cleanup``, with the hook's own ServiceAccount (the chart's RBAC and
nothing more), then writes the Job's status as the Job controller does. In the whole lifecycle
the agents and the controller run in Pods (:class:`ReleasePods`): each as its ServiceAccount
with the chart's RBAC (its tokens refused once the ServiceAccount is deleted), SIGTERMed when
its Pod is deleted, the Pod gone once the process has ended, as kubelet does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.node.dra.checkpoint import Checkpoint
from tests.controller.conftest import add_node
from tests.deploy.helm_chart import CHART, HELM, needs_helm
from tests.deploy.test_repo_commands import bash, block, commands, kubectl_env, node_agent
from tests.doubles.apiserver.threaded import ThreadedApiServer
from tests.harness.agent_process import AgentProcess, clean_env, poll_until
from tests.paths import REPO

pytestmark = needs_helm

NAMESPACE = "edge"
WITHIN = 90.0  # seconds: every wait's bound (a loaded CI machine)
# Akri's documented debugEcho install (docs.akri.sh, "Debug Echo")
AKRI_DEBUG_ECHO = (
    *("--set", "agent.allowDebugEcho=true"),
    *("--set", "debugEcho.configuration.enabled=true"),
)


def helm_env(env: dict[str, str], home: Path) -> dict[str, str]:
    """kubectl's environment, with Helm's own directories under ``home`` and none of the
    caller's HELM_* settings (a namespace, a kube context)."""
    return {
        **{k: v for k, v in env.items() if not k.startswith("HELM_")},
        "HELM_CACHE_HOME": str(home / "helm-cache"),
        "HELM_CONFIG_HOME": str(home / "helm-config"),
        "HELM_DATA_HOME": str(home / "helm-data"),
    }


def helm(env: dict[str, str], *args: str) -> str:
    assert HELM is not None
    done = subprocess.run(
        [HELM, *args], env=env, capture_output=True, text=True, timeout=WITHIN, check=False
    )
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def instances(api: Any) -> list[dict[str, Any]]:
    return [i for i in api.list("instances.akri.sh") if i["metadata"]["namespace"] == NAMESPACE]


KUBELET = "tests.akri.sh/kubelet"  # keeps a deleted Pod until its process ended, as kubelet


def account_rules(api: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """Every rule the (Cluster)RoleBindings of ServiceAccount ``namespace/name`` grant it (a
    Role's rules taken cluster-wide: the double binds rules to a token, not to namespaces)."""
    subject = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    rules: list[dict[str, Any]] = []
    for kind, roles in (("clusterrolebindings", "clusterroles"), ("rolebindings", "roles")):
        for binding in api.list(f"{kind}.rbac.authorization.k8s.io"):
            if subject in binding.get("subjects", []):
                ref = binding["roleRef"]["name"]
                role_namespace = binding["metadata"].get("namespace")
                role = api.get(f"{roles}.rbac.authorization.k8s.io", ref, role_namespace)
                rules += (role or {}).get("rules") or []
    return rules


class ReleasePods:
    """The Pods of the processes the test runs for the release's DaemonSet and Deployment:
    what their controllers, the token authenticator and kubelet do. A Pod is created owned by
    its workload (``blockOwnerDeletion``, as their controllers set it) and held by
    :data:`KUBELET`; its process runs as the Pod's ServiceAccount with the RBAC the release
    bound to it, its token refused (401) once that ServiceAccount is deleted. A deleted Pod's
    process gets SIGTERM (up to the Pod's grace period, then SIGKILL); once it ended the Pod
    goes."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.running: dict[str, AgentProcess] = {}  # Pod name: its process
        self.ended: dict[str, int] = {}  # Pod name: its process's exit code
        self.tokens: dict[str, list[str]] = {}  # ServiceAccount: its Pods' tokens
        self._stopping: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._kubelet, name="kubelet", daemon=True)
        self._thread.start()

    def start(
        self,
        kind: str,
        owner: str,
        pod_name: str,
        node: str,
        home: Path,
        run: Callable[[dict[str, Any], Path], AgentProcess],
    ) -> AgentProcess:
        """A Pod of the workload ``kind/owner`` on ``node``; ``run(pod, kubeconfig)`` starts its
        process with its ServiceAccount's token."""
        resource = {"DaemonSet": "daemonsets.apps", "Deployment": "deployments.apps"}[kind]
        workload = self.api.get(resource, owner, self.namespace)
        spec = workload["spec"]["template"]["spec"]
        account = spec["serviceAccountName"]
        pod = self.api.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": pod_name, "namespace": self.namespace, "finalizers": [KUBELET],
                "labels": workload["spec"]["template"]["metadata"]["labels"],
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": kind, "name": owner,
                    "uid": workload["metadata"]["uid"], "controller": True,
                    "blockOwnerDeletion": True,
                }],
            },
            "spec": {**spec, "nodeName": node},
        })  # fmt: skip
        token = f"{account}-{pod_name}"
        rules = account_rules(self.api, self.namespace, account)
        self.api.add_user(token, f"system:serviceaccount:{self.namespace}:{account}", rules,
                          node=node)  # fmt: skip
        self.tokens.setdefault(account, []).append(token)
        process = run(pod, self.api.write_kubeconfig(home / f"{pod_name}-kubeconfig", token=token))
        self.running[pod_name] = process
        return process

    def _kubelet(self) -> None:
        while not self._done.wait(0.05):
            for account, tokens in list(self.tokens.items()):  # (start() adds to it)
                if self.api.get("serviceaccounts", account, self.namespace) is None:
                    for token in list(tokens):
                        self.api.revoke_user(token)
            for name in list(self.running):
                pod = self.api.get("pods", name, self.namespace)
                if name in self._stopping or not pod or "deletionTimestamp" not in pod["metadata"]:
                    continue
                self._stopping.add(name)
                grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 30)
                threading.Thread(target=self._terminate, args=(name, grace), daemon=True).start()

    def _terminate(self, name: str, grace: float) -> None:
        process = self.running[name]
        try:
            code = process.stop(timeout=grace)
        except AssertionError:
            code = process.kill()
        # recorded before the Pod goes: whoever waits for the Pod sees the process ended
        self.ended[name] = code
        del self.running[name]
        pod = self.api.get("pods", name, self.namespace)
        if pod is not None:
            pod["metadata"]["finalizers"] = [f for f in pod["metadata"]["finalizers"]
                                             if f != KUBELET]  # fmt: skip
            self.api.store.update(self.api.resource("pods"), "v1", self.namespace, name, pod)

    def describe(self) -> str:
        return "\n".join(p.describe() for p in list(self.running.values()))

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        for process in list(self.running.values()):
            process.cleanup()


def controller_process(api: Any, pod: dict[str, Any], kubeconfig: Path) -> AgentProcess:
    """The controller the Deployment describes, in ``pod`` (its downward-API variables)."""
    deployment = api.get("deployments.apps", "akri-controller", pod["metadata"]["namespace"])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    fields = {"metadata.name": pod["metadata"]["name"],
              "metadata.namespace": pod["metadata"]["namespace"]}  # fmt: skip
    env = {
        var["name"]: var["value"]
        if "value" in var
        else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        for var in container["env"]
    }
    env["AKRI_LOG_FORMAT"] = "text"
    command, *args = container["args"]
    return AgentProcess([*args, "--kubeconfig", str(kubeconfig), "--health-port", "0"],
                        command=command, env=env, label="controller")  # fmt: skip


def run_hook_job(
    api: Any, env: dict[str, str], home: Path, namespace: str = NAMESPACE
) -> subprocess.CompletedProcess[str]:
    """What the Job controller and kubelet do with the pre-delete hook Job: run its container's
    command with its ServiceAccount's permissions, then record that it completed."""
    job = poll_until(
        lambda: api.get("jobs.batch", "akri-cleanup-hook", namespace),
        timeout=WITHIN,
        message="helm uninstall created no hook Job",
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "akri-cleanup-hook"
    (container,) = pod["containers"]
    rules = account_rules(api, namespace, "akri-cleanup-hook")
    api.add_user("hook", f"system:serviceaccount:{namespace}:akri-cleanup-hook", rules)
    kubeconfig = api.write_kubeconfig(home / "hook-kubeconfig", token="hook")
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", *container["args"], "--kubeconfig", str(kubeconfig)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=WITHIN + 180,
        check=False,
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    outcome = "Complete" if done.returncode == 0 else "Failed"
    status = {
        "startTime": now,
        "completionTime": now,
        "succeeded" if done.returncode == 0 else "failed": 1,
        "conditions": [
            {"type": "SuccessCriteriaMet" if done.returncode == 0 else "FailureTarget",
             "status": "True", "lastTransitionTime": now},
            {"type": outcome, "status": "True", "lastTransitionTime": now},
        ],
    }  # fmt: skip
    bash(
        f"kubectl patch job -n {namespace} akri-cleanup-hook --subresource=status "
        f"--type=merge -p '{json.dumps({'status': status})}'",
        env,
    )
    return done


def test_install_upgrade_uninstall_as_an_akri_user(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with ThreadedApiServer() as api:  # no CRDs: the chart installs them
        env = helm_env(kubectl_env(api, home), home)
        kubeconfig = ("--kubeconfig", env["KUBECONFIG"])
        # helm install, Akri's debugEcho values, a namespace of the user's choosing
        out = helm(env, "install", "akri", str(CHART), "-n", NAMESPACE, "--create-namespace",
                   *AKRI_DEBUG_ECHO, *kubeconfig)  # fmt: skip
        assert "STATUS: deployed" in out
        config = api.get("configurations.akri.sh", "akri-debug-echo", NAMESPACE)
        assert config["spec"]["capacity"] == 2
        daemonset = api.get("daemonsets.apps", "akri-agent", NAMESPACE)
        assert daemonset["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        add_node(api, "node-a")
        pods = ReleasePods(api, NAMESPACE)

        def agent_in(pod: dict[str, Any], kubeconfig: Path) -> AgentProcess:
            return node_agent(api, "node-a", tmp_path, home, pod=pod, kubeconfig=kubeconfig)

        def controller_in(pod: dict[str, Any], kubeconfig: Path) -> AgentProcess:
            return controller_process(api, pod, kubeconfig)

        # node-a's empty DRA checkpoint, as a node where a claim was prepared and unprepared
        # has it: only an agent that knows it is uninstalled removes it (and its directory)
        checkpoint = tmp_path / "node-a" / "dra" / "checkpoint.json"
        Checkpoint(checkpoint, durable=False).save()
        controller = pods.start("Deployment", "akri-controller", "akri-controller-6f9c-x1",
                                "node-a", home, controller_in)  # fmt: skip
        agent = pods.start("DaemonSet", "akri-agent", "akri-agent-x1", "node-a", home, agent_in)
        first_agent = agent
        try:
            poll_until(
                lambda: (
                    len(instances(api)) == 2
                    and all(i["spec"]["capacity"] == 2 for i in instances(api))
                    and api.get("leases.coordination.k8s.io", "akri-controller", NAMESPACE)
                ),
                timeout=WITHIN,
                message=lambda: pods.describe(),
            )
            uids = {i["metadata"]["uid"] for i in instances(api)}
            # a slot held on node-a (as a device-plugin pod's, recorded by the agent)
            held = sorted(i["metadata"]["name"] for i in instances(api))[0]
            usage = json.dumps({"spec": {"deviceUsage": {f"{held}-0": "node-a"}}})
            bash(f"kubectl patch akrii -n {NAMESPACE} {held} --type merge -p '{usage}'", env)

            # helm upgrade: a capacity and a new image tag, applied in place
            out = helm(env, "upgrade", "akri", str(CHART), "-n", NAMESPACE, "--reuse-values",
                       "--set", "debugEcho.configuration.capacity=3",
                       "--set", "agent.image.tag=0.1.1", *kubeconfig)  # fmt: skip
            assert "STATUS: deployed" in out and "REVISION: 2" in out
            upgraded = api.get("configurations.akri.sh", "akri-debug-echo", NAMESPACE)
            assert upgraded["metadata"]["uid"] == config["metadata"]["uid"]
            assert upgraded["spec"]["capacity"] == 3
            rolled = api.get("daemonsets.apps", "akri-agent", NAMESPACE)
            assert rolled["metadata"]["uid"] == daemonset["metadata"]["uid"]
            (container,) = rolled["spec"]["template"]["spec"]["containers"]
            assert container["image"] == "ghcr.io/akri-py/akri-agent:0.1.1"
            # the rollout: the DaemonSet controller deletes the agent's Pod and starts a new
            # one; the old agent, its DaemonSet staying, keeps its DRA checkpoint for it
            api.delete("pods", "akri-agent-x1", NAMESPACE)
            poll_until(lambda: "akri-agent-x1" in pods.ended, timeout=WITHIN,
                       message=lambda: first_agent.describe())  # fmt: skip
            assert pods.ended["akri-agent-x1"] == 0, first_agent.describe()
            assert checkpoint.exists(), first_agent.describe()
            agent = pods.start("DaemonSet", "akri-agent", "akri-agent-x2", "node-a", home,
                               agent_in)  # fmt: skip
            poll_until(
                lambda: (
                    {i["metadata"]["uid"] for i in instances(api)} == uids
                    and all(i["spec"]["capacity"] == 3 for i in instances(api))
                ),
                timeout=WITHIN,
                message=lambda: agent.describe() + json.dumps(instances(api), indent=1),
            )
            # the held slot is kept through the upgrade and the rollout; the new one is free
            kept = api.get("instances.akri.sh", held, NAMESPACE)["spec"]["deviceUsage"]
            assert kept == {f"{held}-0": "node-a", f"{held}-1": "", f"{held}-2": ""}, kept
            # its pod ends: the slot is free again (as the agent records it), so the uninstall
            # below is not held up by it
            free = json.dumps({"spec": {"deviceUsage": {f"{held}-0": ""}}})
            bash(f"kubectl patch akrii -n {NAMESPACE} {held} --type merge -p '{free}'", env)

            # helm uninstall --wait: the hook deletes the Configurations and waits for the
            # Instances (their agent still runs), then deletes the agents' DaemonSet and the
            # controller's Deployment in the foreground — their RBAC still there — and waits
            # until their Pods are gone, then the controller's Lease; then Helm removes the
            # rest (the DaemonSet and the Deployment already gone: not an error to Helm)
            uninstall = subprocess.Popen(
                [HELM or "helm", "uninstall", "akri", "-n", NAMESPACE, "--wait",
                 "--timeout", "300s", *kubeconfig],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            try:
                hook = run_hook_job(api, env, home)
                out, _ = uninstall.communicate(timeout=WITHIN)
            finally:
                if uninstall.poll() is None:
                    uninstall.kill()
            assert hook.returncode == 0, hook.stderr
            assert "deleted 1 Configuration(s): edge/akri-debug-echo" in hook.stderr
            assert "the uninstall can go on" in hook.stderr
            assert "deleting DaemonSet edge/akri-agent in the foreground" in hook.stderr
            assert "deleted the controller's Lease edge/akri-controller" in hook.stderr
            assert uninstall.returncode == 0, out
            assert 'release "akri" uninstalled' in out
            # the agent saw its DaemonSet being deleted (its RBAC still there), knew it was
            # uninstalled, not rolled, and removed its empty DRA checkpoint and directory
            assert pods.running == {}, pods.describe()
            assert pods.ended["akri-agent-x2"] == 0, agent.describe()
            assert agent.matching("uninstalled: removed the empty DRA checkpoint"), agent.describe()
            assert not checkpoint.parent.exists(), agent.describe()
            assert pods.ended["akri-controller-6f9c-x1"] == 0, controller.describe()
        finally:
            pods.close()
            for each in (first_agent, agent, controller):
                each.cleanup()
        # nothing of the release is left, nothing is terminating; Helm keeps the CRDs of crds/
        left = {
            kind: [o["metadata"]["name"] for o in api.list(kind)
                   if o["metadata"].get("namespace") in (NAMESPACE, None)]
            for kind in ("configurations.akri.sh", "instances.akri.sh", "daemonsets.apps",
                         "deployments.apps", "serviceaccounts", "roles.rbac.authorization.k8s.io",
                         "rolebindings.rbac.authorization.k8s.io", "jobs.batch", "secrets",
                         "clusterroles.rbac.authorization.k8s.io",
                         "clusterrolebindings.rbac.authorization.k8s.io",
                         "validatingadmissionpolicies.admissionregistration.k8s.io",
                         "validatingadmissionpolicybindings.admissionregistration.k8s.io",
                         "deviceclasses.resource.k8s.io", "pods",
                         "leases.coordination.k8s.io")
        }  # fmt: skip
        assert all(not names for names in left.values()), left
        crds = [c["metadata"]["name"] for c in api.list("customresourcedefinitions")]
        assert sorted(crds) == ["configurations.akri.sh", "instances.akri.sh"]
        assert all(
            "deletionTimestamp" not in c["metadata"] for c in api.list("customresourcedefinitions")
        )


def test_a_schema_refusal_stops_helm_install(tmp_path: Path) -> None:
    """A misspelled value: helm install fails naming it, and installs nothing."""
    home = tmp_path / "home"
    with ThreadedApiServer() as api:
        env = helm_env(kubectl_env(api, home), home)
        assert HELM is not None
        done = subprocess.run(
            [HELM, "install", "akri", str(CHART), "-n", NAMESPACE, "--create-namespace",
             "--set", "debugEcho.configuraton.enabled=true", "--kubeconfig", env["KUBECONFIG"]],
            env=env, capture_output=True, text=True, timeout=WITHIN, check=False,
        )  # fmt: skip
        assert done.returncode != 0
        assert "additional properties 'configuraton' not allowed" in done.stderr
        assert api.list("daemonsets.apps") == []
        assert api.list("secrets") == []


def test_the_readme_helm_blocks_run_as_written(tmp_path: Path) -> None:
    """The README's Helm install (Akri's debugEcho values) and its uninstall, as written, with
    two agents started as the installed DaemonSet would start them, and the hook Job run."""
    install, look = commands(block("README.md", "helm install akri deploy/helm/akri"))
    uninstall = block("README.md", "helm uninstall akri -n akri --wait").strip()
    home = tmp_path / "home"
    with ThreadedApiServer() as api:
        env = helm_env(kubectl_env(api, home), home)
        assert "STATUS: deployed" in bash(install, env)
        agents = [node_agent(api, n, tmp_path, home) for n in ("node-a", "node-b")]
        try:

            def each_node_has_two() -> list[list[str]] | None:
                rows = [line.split() for line in bash(look, env).splitlines()[1:]]
                nodes = [row[3] for row in rows if row and row[0].startswith("akri-debug-echo")]
                has_both = all("node-a" in n and "node-b" in n for n in nodes)
                return rows if len(nodes) == 2 and has_both else None

            poll_until(
                each_node_has_two,
                timeout=WITHIN,
                interval=0.5,
                message=lambda: bash(look, env) + "\n".join(a.describe() for a in agents),
            )
            running = subprocess.Popen(
                ["bash", "-c", uninstall], cwd=REPO, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                hook = run_hook_job(api, env, home, "akri")
                out, _ = running.communicate(timeout=WITHIN)
            finally:
                if running.poll() is None:
                    running.kill()
        finally:
            for agent in agents:
                agent.cleanup()
        assert hook.returncode == 0, hook.stderr
        assert running.returncode == 0 and 'release "akri" uninstalled' in out, out
        assert api.list("instances.akri.sh") == [] and api.list("daemonsets.apps") == []


def test_the_installed_policy_refuses_a_typo_at_the_api_server(tmp_path: Path) -> None:
    """After helm install, the API server (the double, enforcing its stored admission
    policies) refuses ``kubectl apply`` of a Configuration whose broker has ``nodeSelecter``,
    naming it, and accepts it without the typo; with webhookConfiguration.enabled=false the
    typo goes through, as on Akri without its webhook."""
    broker = {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": "cams", "namespace": NAMESPACE},
        "spec": {
            "discoveryHandler": {"name": "debugEcho", "discoveryDetails": "descriptions: [a]"},
            "capacity": 1,
            "brokerSpec": {
                "brokerPodSpec": {
                    "nodeSelecter": {"kubernetes.io/os": "linux"},
                    "containers": [{"name": "b", "image": "nginx"}],
                }
            },
        },
    }
    typo = tmp_path / "typo.yaml"
    typo.write_text(json.dumps(broker))
    home = tmp_path / "home"
    with ThreadedApiServer(admission_policies=True) as api:
        env = helm_env(kubectl_env(api, home), home)
        kubeconfig = ("--kubeconfig", env["KUBECONFIG"])
        helm(env, "install", "akri", str(CHART), "-n", NAMESPACE, "--create-namespace", *kubeconfig)
        done = subprocess.run(
            ["kubectl", "apply", "-f", str(typo)], env=env, capture_output=True, text=True,
            timeout=WITHIN, check=False,
        )  # fmt: skip
        assert done.returncode != 0
        assert (
            "ValidatingAdmissionPolicy 'akri-configuration-broker-fields' with binding "
            "'akri-configuration-broker-fields' denied request: spec.brokerSpec.brokerPodSpec / "
            "brokerJobSpec.template.spec (PodSpec) has unknown field(s): nodeSelecter"
        ) in done.stderr, done.stderr
        assert api.list("configurations.akri.sh") == []
        del broker["spec"]["brokerSpec"]["brokerPodSpec"]["nodeSelecter"]
        typo.write_text(json.dumps(broker))
        bash(f"kubectl apply -f {typo}", env)
        assert [c["metadata"]["name"] for c in api.list("configurations.akri.sh")] == ["cams"]
        # the policy off: the typo is stored (and would silently do nothing)
        helm(env, "upgrade", "akri", str(CHART), "-n", NAMESPACE, "--reuse-values",
             "--set", "webhookConfiguration.enabled=false", *kubeconfig)  # fmt: skip
        broker["spec"]["brokerSpec"]["brokerPodSpec"]["nodeSelecter"] = {"a": "b"}
        typo.write_text(json.dumps(broker))
        bash(f"kubectl apply -f {typo}", env)
        stored = api.get("configurations.akri.sh", "cams", NAMESPACE)
        assert stored["spec"]["brokerSpec"]["brokerPodSpec"]["nodeSelecter"] == {"a": "b"}


def handler_process(api: Any, name: str, node: str, tmp: Path) -> AgentProcess:
    """The handler the chart's ``<handler>.discovery`` DaemonSet would start on ``node``: its
    container's arguments and environment, the node's directories under ``tmp`` (the same
    ones :func:`node_agent` gives the agent)."""
    daemonset = api.get("daemonsets.apps", name, NAMESPACE)
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    assert env["DISCOVERY_HANDLERS_DIRECTORY"] == "/var/lib/akri"
    env["DISCOVERY_HANDLERS_DIRECTORY"] = str(tmp / node / "akri")  # the node's /var/lib/akri
    env["AKRI_DEBUG_ECHO_AVAILABILITY_FILE"] = str(tmp / "available")
    command, *args = container["args"]
    return AgentProcess(args, command=command, env=env, label=f"{name}@{node}")


def test_a_charted_discovery_handler_daemonset_serves_the_agent(tmp_path: Path) -> None:
    """Akri's architecture: debugEcho.discovery.enabled=true runs `akri handler debugEcho` as
    its own DaemonSet; with the agent's embedded debugEcho off (no agent.allowDebugEcho), the
    Configuration's Instances come from that handler, over Akri's discovery protocol."""
    home = tmp_path / "home"
    with ThreadedApiServer() as api:
        env = helm_env(kubectl_env(api, home), home)
        helm(env, "install", "akri", str(CHART), "-n", NAMESPACE, "--create-namespace",
             "--set", "debugEcho.configuration.enabled=true",
             "--set", "debugEcho.discovery.enabled=true",
             "--kubeconfig", env["KUBECONFIG"])  # fmt: skip
        (container,) = api.get("daemonsets.apps", "akri-agent", NAMESPACE)["spec"]["template"][
            "spec"
        ]["containers"]
        assert "AKRI_DEBUG_ECHO" not in {var["name"] for var in container["env"]}
        agent = node_agent(api, "node-a", tmp_path, home)
        processes = [agent]
        try:
            handler = handler_process(api, "akri-debug-echo-discovery", "node-a", tmp_path)
            processes.append(handler)
            poll_until(
                lambda: len(instances(api)) == 2,
                timeout=WITHIN,
                message=lambda: agent.describe() + handler.describe(),
            )
            assert agent.matching("registered.*debugEcho|debugEcho.*regist"), agent.describe()
        finally:
            for process in processes:
                process.cleanup()
