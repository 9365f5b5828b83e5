"""Broken state → a clean error naming the file, for any content (issue 23, item 5).

The loaders of the local store (Instance files, the resource-version counter) and of the DRA
checkpoint are fuzzed with hypothesis: arbitrary bytes, arbitrary JSON, and valid documents
with one field replaced by an arbitrary JSON value. Each either loads or raises
:class:`CorruptStateError` naming the file — never another exception (which the agent would
turn into a traceback and exit code 1). The cases the review found are kept as explicit ones,
and two run through the real ``akri agent`` to check the exit code and the output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.store.base import CorruptStateError
from agent.core.store.local import (
    COUNTER_FILE,
    load_instance_file,
    read_counter_file,
    read_state_dir,
)
from agent.node.dra.checkpoint import Checkpoint
from tests.paths import REPO

FUZZ = settings(
    max_examples=300,
    deadline=None,  # a loaded CI machine must not turn slowness into a failure
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)

VALID_INSTANCE: dict[str, Any] = {
    "apiVersion": "akri.sh/v0",
    "kind": "Instance",
    "metadata": {
        "name": "cam-8120fe",
        "namespace": "default",
        "resourceVersion": "7",
        "uid": "u-1",
        "labels": {"a": "b"},
        "annotations": {"akri.sh/draining": "n1"},
        "ownerReferences": [{"kind": "Configuration", "name": "cam", "uid": "c-1"}],
    },
    "spec": {
        "configurationName": "cam",
        "capacity": 2,
        "shared": True,
        "nodes": ["n1"],
        "deviceUsage": {"cam-8120fe-0": "n1", "cam-8120fe-1": ""},
        "brokerProperties": {"K": "v"},
    },
}

VALID_CHECKPOINT: dict[str, Any] = {
    "version": 2,
    "preparedClaims": {
        "u1": {
            "uid": "u1",
            "namespace": "default",
            "name": "c1",
            "devices": [
                {
                    "request_names": ["req"],
                    "pool": "cam-8120fe",
                    "device": "cam-8120fe-0",
                    "instance": "cam-8120fe",
                    "slot": "cam-8120fe-0",
                    "cdi_device_ids": ["k8s.akri.sh/device=u1-cam-8120fe-0"],
                    "share_id": None,
                    "namespace": "default",
                }
            ],
        }
    },
    "preparingClaims": {"u2": {"namespace": "default", "name": "c2"}},
}


def _paths(document: Any) -> list[tuple[Any, ...]]:
    """Every path (keys and indexes) into ``document``, the root included."""
    found: list[tuple[Any, ...]] = [()]
    if isinstance(document, dict):
        for key, value in document.items():
            found += [(key, *rest) for rest in _paths(value)]
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += [(index, *rest) for rest in _paths(value)]
    return found


def _replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(document))
    target = copy
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return copy


def _load_instance(tmp: Path, content: bytes) -> None:
    path = tmp / "cam-8120fe.json"
    path.write_bytes(content)
    try:
        load_instance_file(path)
    except CorruptStateError as error:
        assert error.path == str(path)


def _load_checkpoint(tmp: Path, content: bytes) -> None:
    path = tmp / "checkpoint.json"
    path.write_bytes(content)
    try:
        Checkpoint(path).load()
    except CorruptStateError as error:
        assert error.path == str(path)


@FUZZ
@given(content=st.binary(max_size=200))
def test_any_bytes(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _load_instance(Path(tmp), content)
        _load_checkpoint(Path(tmp), content)
        counter = Path(tmp) / COUNTER_FILE
        counter.write_bytes(content)
        try:
            assert read_counter_file(counter) is not None
        except CorruptStateError as error:
            assert error.path == str(counter)


@FUZZ
@given(document=json_values)
def test_any_json(document: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        content = json.dumps(document).encode()
        _load_instance(Path(tmp), content)
        _load_checkpoint(Path(tmp), content)


@FUZZ
@given(data=st.data(), value=json_values)
def test_a_valid_instance_with_one_field_replaced(data: st.DataObject, value: Any) -> None:
    path = data.draw(st.sampled_from(_paths(VALID_INSTANCE)))
    with tempfile.TemporaryDirectory() as tmp:
        _load_instance(Path(tmp), json.dumps(_replaced(VALID_INSTANCE, path, value)).encode())


@FUZZ
@given(data=st.data(), value=json_values)
def test_a_valid_checkpoint_with_one_field_replaced(data: st.DataObject, value: Any) -> None:
    path = data.draw(st.sampled_from(_paths(VALID_CHECKPOINT)))
    with tempfile.TemporaryDirectory() as tmp:
        _load_checkpoint(Path(tmp), json.dumps(_replaced(VALID_CHECKPOINT, path, value)).encode())


def test_the_valid_documents_load(tmp_path: Path) -> None:
    """The fuzzed documents really are valid: the tests start from loadable state."""
    path = tmp_path / "cam-8120fe.json"
    path.write_text(json.dumps(VALID_INSTANCE))
    assert load_instance_file(path).device_usage["cam-8120fe-0"] == "n1"
    book = tmp_path / "checkpoint.json"
    book.write_text(json.dumps(VALID_CHECKPOINT))
    checkpoint = Checkpoint(book)
    checkpoint.load()
    assert set(checkpoint.claims) == {"u1"} and set(checkpoint.pending) == {"u2"}


REVIEW_CASES = {
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "annotations as a string": json.dumps(
        _replaced(VALID_INSTANCE, ("metadata", "annotations"), "akri.sh/draining=n1")
    ).encode(),
    "labels as a list": json.dumps(
        _replaced(VALID_INSTANCE, ("metadata", "labels"), ["a", "b"])
    ).encode(),
    "ownerReferences: [1]": json.dumps(
        _replaced(VALID_INSTANCE, ("metadata", "ownerReferences"), [1])
    ).encode(),
    "superscript resourceVersion": json.dumps(
        _replaced(VALID_INSTANCE, ("metadata", "resourceVersion"), "²")
    ).encode(),
    "capacity 10**12": json.dumps(_replaced(VALID_INSTANCE, ("spec", "capacity"), 10**12)).encode(),
}


@pytest.mark.parametrize("content", REVIEW_CASES.values(), ids=REVIEW_CASES.keys())
def test_the_review_cases_are_corrupt_state(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "cam-8120fe.json"
    path.write_bytes(content)
    with pytest.raises(CorruptStateError) as caught:
        load_instance_file(path)
    assert str(path) in str(caught.value)
    book = tmp_path / "checkpoint.json"
    book.write_bytes(content)
    with pytest.raises(CorruptStateError):
        Checkpoint(book).load()


def test_a_superscript_counter_is_corrupt_state(tmp_path: Path) -> None:
    (tmp_path / COUNTER_FILE).write_text("²\n")  # str.isdigit() says yes, int() says no
    with pytest.raises(CorruptStateError, match=COUNTER_FILE):
        read_state_dir(tmp_path)


def _agent(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "agent",
            "--local",
            "--state-dir",
            str(state_dir),
            "--node-name",
            "n1",
            "--no-debug-echo",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", ["deep nesting", "ownerReferences: [1]"])
def test_the_agent_exits_3_naming_the_file(tmp_path: Path, case: str) -> None:
    instances = tmp_path / "state" / "instances"
    instances.mkdir(parents=True)
    broken = instances / "cam-8120fe.json"
    broken.write_bytes(REVIEW_CASES[case])
    result = _agent(tmp_path / "state")
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert str(broken) in output and "Traceback" not in output


def test_a_broken_dra_checkpoint_stops_a_cluster_agent_with_exit_3(tmp_path: Path) -> None:
    """Before: an unreadable checkpoint was replaced by an empty one ("starting empty"), and
    the ``D:`` slots it traced could never be freed. Now the agent refuses to start, naming
    the file and what to do (against the API-server double, as in a cluster)."""
    from tests.doubles.apiserver.threaded import ThreadedApiServer
    from tests.harness.agent_process import AgentProcess
    from tests.harness.k8s_nodes import CRDS
    from tests.node.test_kube_start import cluster_agent_args

    # unix socket paths are limited to 107 bytes: the kubelet-facing directories stay short
    base = Path(tempfile.mkdtemp(prefix="cp-", dir="/tmp"))
    try:
        book = base / "dra" / "checkpoint.json"
        book.parent.mkdir()
        book.write_bytes(b'{"version": 2, "preparedClaims": {"u1": {"namespace": 1}}}')
        with ThreadedApiServer(crds=CRDS) as server:
            kubeconfig = server.write_kubeconfig(base / "kubeconfig")
            agent = AgentProcess(cluster_agent_args(kubeconfig, base))
            try:
                code = agent.wait_exit(60)
            finally:
                agent.cleanup()
        assert code == 3, agent.describe()
        assert agent.matching(rf"refusing to start: state file {book} is corrupt"), agent.describe()
        assert agent.matching("move it aside"), agent.describe()
        assert not agent.matching("Traceback"), agent.describe()
    finally:
        shutil.rmtree(base, ignore_errors=True)
