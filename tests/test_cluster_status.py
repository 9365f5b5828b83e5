"""``akri status --kubeconfig`` against the API-server double: Configurations and Instances
of every namespace, slot holders and health, table and JSON; a clear error without a
cluster."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.model.instance import Instance
from tests.agent_process import clean_env
from tests.apiserver import ApiServerDouble
from tests.dp_nodes import one_device_configuration
from tests.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def akri(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_status_reads_the_cluster(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), 2))
    other = one_device_configuration("cam", ("foo0",), 1)
    other["metadata"]["namespace"] = "lab"
    api.create(other)
    instance = Instance(
        name="cam-8120fe",
        configuration_name="cam",
        capacity=2,
        shared=True,
        nodes=("node-a", "node-b"),
        device_usage={"cam-8120fe-0": "node-a", "cam-8120fe-1": ""},
        annotations={"akri.sh/offline": "node-b"},
    )
    api.create(instance.to_dict())
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    code, out, err = await akri("status", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert "lab/cam" in out and "debugEcho" in out
    line = next(row for row in out.splitlines() if row.startswith("cam-8120fe"))
    assert "node-a,node-b" in line and "offline (node-b)" in line and "0=node-a 1=-" in line
    config_row = next(row for row in out.splitlines() if row.startswith("cam "))
    assert config_row.split()[-2:] == ["1", "1/2"]  # one Instance, 1 of 2 slots used

    code, out, err = await akri("status", "--kubeconfig", str(kubeconfig), "-o", "json")
    assert code == 0, err
    (item,) = json.loads(out)
    assert item["spec"]["deviceUsage"] == {"cam-8120fe-0": "node-a", "cam-8120fe-1": ""}

    code, out, _err = await akri("status", "--kubeconfig", str(kubeconfig), "-n", "lab")
    assert code == 0 and "cam-8120fe" not in out and "lab/cam" in out


async def test_status_without_a_reachable_cluster_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "none.yaml"
    code, _out, err = await akri("status", "--kubeconfig", str(missing))
    assert code == 4 and "cannot read the cluster" in err
