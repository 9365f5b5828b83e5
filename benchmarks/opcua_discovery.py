"""The opcua handler's figures (issue 35), local mode, everything on loopback.

**footprint** — does the handler cost an agent that has no opcua Configuration anything?
``akri agent --local`` with 3 debugEcho devices and device plugins, next to a kubelet double:

- ``startup_first_list_ms``: ``Popen`` → the kubelet double's first ListAndWatch message;
- ``startup_cpu_ms``: the CPU time (user + system, all threads) the agent used until then,
  which the machine's load inflates far less than the wall-clock time;
- ``idle_rss_mb``: the agent's VmRSS 3 s after that first list;

for the checkout given with ``--before`` (main before the handler) and the one given with
``--after`` (default: this one; give the commit that added the handler to compare the two
alone), measured alternately (one start of each in turn, so both see the same machine load);
and for this checkout with an opcua Configuration as well (``with_opcua``: what the handler
costs once used; its server does not exist, so the handler keeps asking).

**latency** — an asyncua server (``tests/doubles/opcua_servers.py``, a process) on a loopback
port, started and killed ``--cycles`` times; the agent (this checkout, ``--shared-offline-grace
0`` so only detection is measured) with an opcua Configuration naming it, default intervals
(recheck 10 s, retry 1 s, timeout 3 s):

- ``opcua_server_to_instance_ms``: the server prints ``ready`` (listening) → its Instance file;
- ``opcua_server_gone_to_instance_gone_ms``: the server killed (SIGKILL) → the file is gone.

**plant** (issue 42, root: a mount namespace) — a discovery server on loopback listing the
servers of a :class:`Plant` (``--plant-scenario``, :data:`PLANTS`; ``issue``: 200 servers,
50 on ports nobody listens on, 10 under names a DNS server that never answers should resolve
— the agent runs in a mount namespace whose ``/etc/resolv.conf`` names a UDP port the
benchmark binds and never reads, ``timeout:30 attempts:5`` — and the rest light servers
(``answering`` in ``tests/doubles/opcua_servers.py``) under names in its ``/etc/hosts``;
``dead``: 250 stale registrations; ``hostile``: 20 URLs of one server with a ~0.9 MB
answer). Each checkout given with ``--plant`` runs ``akri agent --local`` with one
Configuration naming the discovery server (default intervals) for ``--plant-seconds``, in
turn:

- ``first_list_s`` / ``first_list_devices``: start → the handler's first device list (the
  agent's "opcua reports N device(s)" line), and N;
- ``all_reachable_s``: start → an Instance for every reachable server under its own URL
  (None: not within the run; ``own_url_instances`` says how many were);
- ``rss_mb`` at the end and ``peak_rss_mb`` (VmHWM), ``cpu_percent_last_30s`` (what the
  dead servers cost once settled), ``loop_lag_max_ms`` (the agent's own figure, printed
  when it stops).

``python -m benchmarks.opcua_discovery --before /tmp/opcua-before [--after /tmp/opcua-after]
[--startups 8] [--cycles 5] [--plant /tmp/before --plant .] [--plant-scenario issue]
[--plant-seconds 90]
[--out benchmarks/results-opcua.json]`` prints the JSON (and writes it with ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import PROCESSES, ROOT, TimedKubelet, agent_env, cpu_seconds, rss_mb
from benchmarks.local_agent import InstanceFiles, LocalAgent
from benchmarks.local_mode import LAG_LINE
from benchmarks.local_mode import configuration as debug_echo_configuration
from benchmarks.stats import summarize
from tests.doubles.opcua_servers import free_ports

SETTLE = 3.0  # seconds after the first list before RSS is read


def _opcua_configuration(url: str, name: str = "plcs") -> str:
    return (
        f"apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {{name: {name}}}\nspec:\n"
        "  discoveryHandler:\n    name: opcua\n    discoveryDetails: |\n"
        "      opcuaDiscoveryMethod:\n        standard:\n"
        f"          discoveryUrls: ['{url}']\n"
        "  capacity: 1\n"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``seconds``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    PROCESSES.discard(proc)


def _compile(root: Path, env: dict[str, str]) -> None:
    """Bytecode as an installed agent has it (see benchmarks/local_mode.compiled_env)."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "agent", "discovery_handlers"],
        cwd=root, env=env, check=True,
    )  # fmt: skip


async def _one_start(
    root: Path, env: dict[str, str], configs: list[str]
) -> tuple[float, float, float]:
    """(ms from Popen to the first ListAndWatch, CPU ms until then, VmRSS MB ``SETTLE`` s
    later) of ``akri agent --local`` run from ``root`` (``python -m`` puts the checkout first
    on ``sys.path``)."""
    base = Path(tempfile.mkdtemp(prefix="akri-opcua-fp-", dir="/tmp"))
    (base / "dp").mkdir()
    config_flags: list[str] = []
    for index, text in enumerate(configs):
        path = base / f"c{index}.yaml"
        path.write_text(text)
        config_flags += ["--config", str(path)]
    kubelet = TimedKubelet(base / "dp", base / "pr.sock", reregistration="kubelet")
    await kubelet.start()
    log = (base / "agent.log").open("wb")
    started = time.monotonic()
    proc = subprocess.Popen(  # noqa: ASYNC220 - timed from here, no await between
        [
            sys.executable, "-m", "agent.cli", "agent", "--local",
            "--state-dir", str(base / "state"), *config_flags,
            "--device-plugin-dir", str(base / "dp"),
            "--pod-resources-socket", str(base / "pr.sock"),
            "--debug-echo-availability-file", str(base / "avail"),
            "--node-name", "bench-opcua",
        ],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
    )  # fmt: skip
    PROCESSES.add(proc)
    try:
        deadline = started + 60
        while not kubelet.list_and_watch_log:
            if time.monotonic() > deadline or proc.poll() is not None:
                tail = (base / "agent.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"no ListAndWatch from {root}:\n{tail}")
            await asyncio.sleep(0.001)
        first = (kubelet.list_and_watch_log[0].time - started) * 1000
        cpu = cpu_seconds(proc.pid) * 1000
        await asyncio.sleep(SETTLE)
        return first, cpu, rss_mb(proc.pid)
    finally:
        _stop(proc, 10)
        log.close()
        await kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


async def measure_footprint(before: Path, after: Path, startups: int) -> dict[str, Any]:
    env = agent_env()
    for root in {before, after, ROOT}:
        _compile(root, env)
    debug_echo = debug_echo_configuration("startup", ["a", "b", "c"], 1)
    opcua = _opcua_configuration(f"opc.tcp://127.0.0.1:{_free_port()}/")
    runs: dict[str, tuple[Path, list[str]]] = {
        "before": (before, [debug_echo]),
        "after": (after, [debug_echo]),
        "with_opcua": (ROOT, [debug_echo, opcua]),
    }
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for _ in range(startups):
        for name, (root, configs) in runs.items():
            samples[name].append(await _one_start(root, env, configs))
    return {
        name: {
            "root": str(runs[name][0]),
            "commit": _commit(runs[name][0]),
            "startup_first_list_ms": summarize([s[0] for s in values]),
            "startup_cpu_ms": summarize([s[1] for s in values]),
            "idle_rss_mb": summarize([s[2] for s in values]),
        }
        for name, values in samples.items()
    } | {
        "method": "akri agent --local, 3 debugEcho devices, device plugins, kubelet double; "
        "before/after/with_opcua started in turn each round; RSS read "
        f"{SETTLE:g} s after the first ListAndWatch",
    }


def _commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip()


def _instance_urls(state: Path) -> set[str]:
    directory = state / "instances"
    urls: set[str] = set()
    if not directory.is_dir():
        return urls
    for name in os.listdir(directory):
        if name.endswith(".json"):
            try:
                item = json.loads((directory / name).read_text())
            except (OSError, ValueError):
                continue  # a partly visible write: read again next time
            urls.add(item["spec"]["brokerProperties"].get("OPCUA_DISCOVERY_URL", ""))
    return urls


async def _until(check: Any, within: float, what: str, agent: LocalAgent) -> float:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {within} s\n{agent.logs()}")
        await asyncio.sleep(0.005)
    return time.monotonic()


async def _start_server(url: str) -> tuple[asyncio.subprocess.Process, float]:
    spec = [{"kind": "server", "name": "Bench Server", "endpoint": url}]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.doubles.opcua_servers", json.dumps(spec),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 120)
    if not line.startswith(b"ready "):
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, time.monotonic()


async def measure_latency(cycles: int) -> dict[str, Any]:
    url = f"opc.tcp://127.0.0.1:{_free_port()}/"
    agent = LocalAgent(
        _opcua_configuration(url), "akri-opcua-lat-", extra=["--shared-offline-grace", "0"]
    )
    appear: list[float] = []
    gone: list[float] = []
    try:
        for _ in range(cycles):
            server, ready = await _start_server(url)
            try:
                seen = await _until(
                    lambda: url in _instance_urls(agent.state), 60, "the Instance", agent
                )
                appear.append((seen - ready) * 1000)
            finally:
                server.kill()
                killed = time.monotonic()
                await server.wait()
            went = await _until(
                lambda: url not in _instance_urls(agent.state), 60, "the Instance gone", agent
            )
            gone.append((went - killed) * 1000)
    finally:
        lag = agent.stop()
    return {
        "opcua_server_to_instance_ms": summarize(appear),
        "opcua_server_gone_to_instance_gone_ms": summarize(gone),
        "loop_lag_max_ms": lag,
        "method": "asyncua server process on loopback started/killed in turn; akri agent "
        "--local --shared-offline-grace 0, default intervals (recheck 10 s, retry 1 s, "
        "timeout 3 s): 'ready' line -> Instance file; SIGKILL -> file gone",
    }


@dataclass(frozen=True)
class Plant:
    """What one discovery server lists: ``reachable`` light servers under /etc/hosts names,
    ``dead`` on ports nobody listens on, ``hung`` under names the silent DNS server should
    resolve, ``hostile`` URLs (distinct paths) of one server whose FindServers answer is
    :data:`FLOOD` descriptions (~0.9 MB)."""

    reachable: int
    dead: int
    hung: int
    hostile: int = 0


PLANTS = {
    # the run: 200 listed servers, 50 unreachable, 10 with unresolvable names
    "issue": Plant(reachable=140, dead=50, hung=10),
    # 250 stale registrations (issue 42.5: retried every second for ever)
    "dead": Plant(reachable=10, dead=250, hung=0),
    # 20 listed URLs of one hostile server (issue 42.3: RSS 56 -> 208 MB)
    "hostile": Plant(reachable=10, dead=0, hung=0, hostile=20),
}
FLOOD = 9000
PLANT_DOMAIN = "plant.example"


def _plant_url(index: int, port: int) -> str:
    return f"opc.tcp://plc-{index}.{PLANT_DOMAIN}:{port}/"


def _plant_listing(
    plant: Plant, lds: str, ports: list[int], closed: list[int], flood: int
) -> list[dict[str, Any]]:
    return [
        {"name": "LDS", "url": lds, "type": 3},
        *({"name": f"PLC {i}", "url": _plant_url(i, port)} for i, port in enumerate(ports)),
        *(
            {"name": f"Dead {i}", "url": f"opc.tcp://127.0.0.1:{port}/"}
            for i, port in enumerate(closed)
        ),
        *(
            {"name": f"Hung {i}", "url": f"opc.tcp://hung-{i}.dns.example:4840/"}
            for i in range(plant.hung)
        ),
        *(
            {"name": f"Hostile {i}", "url": f"opc.tcp://127.0.0.1:{flood}/h{i}"}
            for i in range(plant.hostile)
        ),
    ]


async def _plant_servers(
    plant: Plant, lds_port: int, ports: list[int], closed: list[int], flood: int
) -> Any:
    lds = f"opc.tcp://127.0.0.1:{lds_port}/"
    specs: list[dict[str, Any]] = [
        {"kind": "answering", "name": "LDS", "endpoint": lds,
         "applications": _plant_listing(plant, lds, ports, closed, flood)},
        *(
            {"kind": "answering", "name": f"PLC {i}", "endpoint": f"opc.tcp://127.0.0.1:{port}/",
             "applications": [{"name": f"PLC {i}", "url": _plant_url(i, port)}]}
            for i, port in enumerate(ports)
        ),
    ]  # fmt: skip
    if plant.hostile:
        specs.append(
            {"kind": "answering", "name": "Flood", "endpoint": f"opc.tcp://127.0.0.1:{flood}/",
             "applications": [{"flood": FLOOD}]}
        )  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.doubles.opcua_servers", json.dumps(specs),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    for _ in specs:
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        if not line.startswith(b"ready "):
            raise RuntimeError(f"the plant's servers did not start: {line!r}")
    return process, lds


_REPORTS = re.compile(rb"opcua reports (\d+) device")


async def _plant_run(
    root: Path, lds: str, ports: list[int], dns: str, seconds: float
) -> dict[str, Any]:
    reachable = len(ports)
    base = Path(tempfile.mkdtemp(prefix="akri-opcua-plant-", dir="/tmp"))
    (base / "resolv.conf").write_text(f"nameserver {dns}\noptions timeout:30 attempts:5\n")
    names = " ".join(f"plc-{i}.{PLANT_DOMAIN}" for i in range(reachable))
    (base / "hosts").write_text(f"127.0.0.1 localhost {names}\n")
    config = base / "c.yaml"
    config.write_text(_opcua_configuration(lds))
    (base / "dh").mkdir()
    env = agent_env()
    _compile(root, env)
    agent = (
        f"exec {sys.executable} -m agent.cli agent --local --no-debug-echo "
        f"--state-dir {base / 'state'} --config {config} --discovery-handlers-dir {base / 'dh'} "
        "--node-name bench-plant"
    )
    script = (
        f"mount --bind {base / 'resolv.conf'} /etc/resolv.conf && "
        f"mount --bind {base / 'hosts'} /etc/hosts && {agent}"
    )
    log_path = base / "agent.log"
    log = log_path.open("wb")
    started = time.monotonic()
    proc = subprocess.Popen(  # noqa: ASYNC220 - timed from here
        ["unshare", "-m", "sh", "-c", script],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    PROCESSES.add(proc)
    own = {_plant_url(i, port) for i, port in enumerate(ports)}
    files = InstanceFiles(base / "state", "OPCUA_DISCOVERY_URL")
    first: float | None = None
    first_devices: int | None = None
    everything: float | None = None
    cpu_mark: tuple[float, float] | None = None
    try:
        while (now := time.monotonic()) - started < seconds:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text(errors="replace")[-3000:])
            if first is None:
                found = _REPORTS.search(log_path.read_bytes())
                if found:
                    first, first_devices = now - started, int(found.group(1))
            if everything is None and own <= files.seen():
                everything = now - started
            if cpu_mark is None and now - started >= seconds - 30:
                cpu_mark = (now, cpu_seconds(proc.pid))
            await asyncio.sleep(0.05)
        rss, peak = rss_mb(proc.pid), rss_mb(proc.pid, "VmHWM")
        cpu = None
        if cpu_mark is not None:
            cpu = 100 * (cpu_seconds(proc.pid) - cpu_mark[1]) / (time.monotonic() - cpu_mark[0])
    finally:
        _stop(proc, 20)  # before issue 42, threads stuck in getaddrinfo hold the exit
        log.close()
    lag = LAG_LINE.findall(log_path.read_text(errors="replace"))
    seen = files.seen()
    shutil.rmtree(base, ignore_errors=True)
    return {
        "root": str(root),
        "commit": _commit(root),
        "first_list_s": None if first is None else round(first, 2),
        "first_list_devices": first_devices,
        "all_reachable_s": None if everything is None else round(everything, 2),
        "own_url_instances": len(own & seen),
        "instances": len(seen),
        "rss_mb": round(rss, 1),
        "peak_rss_mb": round(peak, 1),
        "cpu_percent_last_30s": None if cpu is None else round(cpu, 2),
        "loop_lag_max_ms": float(lag[-1]) if lag else None,
    }


async def measure_plant(name: str, roots: list[Path], seconds: float) -> dict[str, Any]:
    plant = PLANTS[name]
    *ports, lds_port, flood = free_ports(plant.reachable + plant.dead + 2)
    ports, closed = ports[: plant.reachable], ports[plant.reachable :]
    dns = f"127.0.{os.getpid() % 200 + 20}.53"
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never read
    silent.bind((dns, 53))
    servers, lds = await _plant_servers(plant, lds_port, ports, closed, flood)
    try:
        runs = [await _plant_run(root, lds, ports, dns, seconds) for root in roots]
    finally:
        servers.kill()
        await servers.wait()
        silent.close()
    listed = plant.reachable + plant.dead + plant.hung + plant.hostile
    return {
        "runs": runs,
        "method": f"{listed} servers listed by one discovery server on loopback: "
        f"{plant.dead} on ports nobody listens on, {plant.hung} under names a silent DNS "
        "server should resolve (mount namespace: resolv.conf -> a UDP port never read, "
        f"timeout:30 attempts:5), {plant.hostile} URLs of one server answering FindServers "
        f"with {FLOOD} descriptions (~0.9 MB), {plant.reachable} light servers under "
        f"/etc/hosts names; akri agent --local, default intervals (recheck 10 s, retry 1 s, "
        f"timeout 3 s), {seconds:g} s per checkout, one after the other",
    }


async def run(
    before: Path | None,
    after: Path,
    startups: int,
    cycles: int,
    plant: list[Path] | None = None,
    plant_seconds: float = 90.0,
    scenarios: list[str] | None = None,
) -> dict[str, Any]:
    results: dict[str, Any] = {"load_average_start": os.getloadavg()[0]}
    if before is not None:
        results["footprint"] = await measure_footprint(before, after, startups)
    if cycles:
        results["latency"] = await measure_latency(cycles)
    for name in scenarios or ["issue"] if plant else []:
        results[f"plant_{name}"] = await measure_plant(name, plant or [], plant_seconds)
    results["load_average_end"] = os.getloadavg()[0]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="checkout of main before the handler")
    parser.add_argument("--after", type=Path, default=ROOT, help="checkout with the handler")
    parser.add_argument("--startups", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--plant", type=Path, action="append", help="a checkout to run the "
                        "plant floor with (root; give several to compare)")  # fmt: skip
    parser.add_argument("--plant-seconds", type=float, default=90.0)
    parser.add_argument("--plant-scenario", action="append", choices=sorted(PLANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        results = asyncio.run(
            run(
                args.before, args.after, args.startups, args.cycles, args.plant,
                args.plant_seconds, args.plant_scenario,
            )
        )  # fmt: skip
    finally:
        PROCESSES.kill_all()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
