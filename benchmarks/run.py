"""Benchmarks of the agent, run as a subprocess against the API-server and kubelet doubles.

    python benchmarks/run.py [--quick] [--out FILE] [--seed N] [--only SECTION ...]

Prints one JSON object on stdout (progress goes to stderr) and writes it to ``--out``. See
docs/performance.md for what each figure means and the results on the reference machine.
A measurement that fails is reported as ``{"error": "..."}`` under its key; the exit code is
1 if any did, 130 if interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` and ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.contention import ContentionPlan, run_contention
from benchmarks.controller import (
    ControllerPlan,
    broker_pod_created,
    controller_scale,
    dead_node_slots_freed,
)
from benchmarks.external_handler import measure_external_handler
from benchmarks.fleet import QUICK as FLEET_QUICK
from benchmarks.fleet import FleetPlan, fleet_options, run_fleet
from benchmarks.harness import (
    LOOP_LAGS,
    PROCESSES,
    ROOT,
    AgentOptions,
    ApiServer,
    agent_flags,
    log,
)
from benchmarks.large_instance import measure_large_instance_cluster
from benchmarks.latency import LatencyBench, LatencyPlan
from benchmarks.local_mode import LocalPlan, measure_idle, measure_large_instance, measure_startup
from benchmarks.many_agents import ManyAgentsPlan, run_many_agents
from benchmarks.network_handlers import measure_mdns, measure_mqtt
from benchmarks.onvif_discovery import measure_onvif
from benchmarks.peer import PeerPlan, run_peer, table
from benchmarks.scale import ScalePlan, run_scale

PLANS: dict[str, dict[str, Any]] = {
    "quick": {
        "latency": LatencyPlan(
            discovery=8,
            flips=0,  # skipped: bounded by debugEcho's 0.5 s poll, ~1 s per sample
            allocations=15,
            restarts=2,
            reclaim_spacing=0.02,
            alloc_devices=8,
            dra_claims=10,
        ),
        # quick: no kubelet restart / SIGTERM measurement at scale (time budget)
        "scale": ScalePlan(
            instances=200,
            idle_seconds=10,
            settle_seconds=0,
            measure_restart=False,
            measure_shutdown=False,
        ),
        "contention": ContentionPlan(),
        "many_agents": ManyAgentsPlan(agents=(5, 10)),
        "fleet": FLEET_QUICK,
        "controller": ControllerPlan(samples=30, dead_node_samples=2, instances=100, nodes=10),
        "local": LocalPlan(
            startups=5,
            idle_seconds=20,
            external=30,
            mqtt_samples=15,
            mqtt_retained=200,
            mdns_samples=8,
        ),
    },
    "full": {
        "latency": LatencyPlan(
            discovery=100,
            flips=20,
            allocations=100,
            restarts=10,
            reclaim_spacing=0.05,
            dra_claims=100,
        ),
        "scale": ScalePlan(instances=1000, idle_seconds=30, settle_seconds=5, shutdown_grace=30),
        "contention": ContentionPlan(),
        "many_agents": ManyAgentsPlan(),
        "fleet": FleetPlan(),
        "controller": ControllerPlan(),
        "local": LocalPlan(startups=10, idle_seconds=60),
    },
}
# the side-by-side section (benchmarks/peer.py): only with --peer-bin
PEER_PLANS = {"quick": PeerPlan(rounds=3, idle_seconds=10), "full": PeerPlan(rounds=5)}
UDEV_SAMPLES = {"quick": 5, "full": 20}
SECTIONS = (
    "latency",
    "scale",
    "contention",
    "many_agents",
    "fleet",
    "controller",
    "udev",
    "local",
    "peer",
)
LATENCY_KEYS = (
    "discovery_to_kubelet_ms",
    "discovery_online_flip_ms",
    "allocate_il_ms",
    "allocate_cl_ms",
    "reclaim_ms",
    "kubelet_restart_reregister_ms",
    "dra_prepare_ms",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument("--out", type=Path, help="also write the JSON result to this file")
    parser.add_argument("--seed", type=int, default=20261122, help="random seed")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument("--logs", type=Path, help="copy every agent's log into this directory")
    parser.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every agent process (repeatable; e.g. --agent-arg=--no-dra)",
    )
    parser.add_argument(
        "--peer-bin",
        type=Path,
        help="squat/generic-device-plugin binary: runs the side-by-side section (skipped "
        "without it; docs/performance.md says how to build it)",
    )
    return parser


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip()


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def environment() -> dict[str, Any]:
    status = _git("status", "--porcelain", "--", "agent", "discovery_handlers")
    flags = agent_flags()
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        # uncommitted changes to the agent's code at the time of the run
        "agent_code_dirty": bool(status) if status is not None else None,
        "agent_has_dra": "--dra" in flags,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict[str, str]:
    text = str(exc).strip() or repr(exc)
    return {"error": f"{type(exc).__name__}: {text[:2000]}"}


async def measure(
    results: dict[str, Any], key: str, run: Callable[[], Awaitable[Any]], within: float
) -> None:
    """``results[key] = await run()``, or ``{"error": ...}`` if it fails or overruns."""
    log(f"measuring {key} (load average {os.getloadavg()[0]:.2f})")
    results.setdefault("load_average_before", {})[key] = round(os.getloadavg()[0], 2)
    started = time.monotonic()
    try:
        results[key] = await asyncio.wait_for(run(), within)
    except asyncio.CancelledError:
        results[key] = {"error": "interrupted"}
        raise
    except TimeoutError as exc:
        results[key] = _error(exc) if str(exc) else {"error": f"timed out after {within:.0f}s"}
    except Exception as exc:
        results[key] = _error(exc)
    log(f"{key}: done in {time.monotonic() - started:.1f}s")


async def latency_section(
    results: dict[str, Any], plan: LatencyPlan, options: AgentOptions, rng: random.Random
) -> None:
    api = ApiServer()
    api.start()
    bench = LatencyBench(api, plan, rng, options)
    try:
        try:
            results["latency_setup"] = await asyncio.wait_for(bench.setup(), 120)
        except Exception as exc:
            failure = _error(exc)
            results["latency_setup"] = failure
            for key in LATENCY_KEYS:
                results[key] = {"error": f"setup failed: {failure['error']}"}
            return
        steps: list[tuple[str, Callable[[], Awaitable[Any]], float]] = [
            ("discovery_to_kubelet_ms", bench.discovery, 60 + plan.discovery * 3),
            ("discovery_online_flip_ms", bench.online_flip, 30 + plan.flips * 5),
            ("allocate_il_ms", lambda: bench.allocate("il"), 60 + plan.allocations),
            ("allocate_cl_ms", lambda: bench.allocate("cl"), 60 + plan.allocations),
            ("reclaim_ms", bench.reclaim, 90 + plan.allocations * 2 * plan.reclaim_spacing * 2),
            ("kubelet_restart_reregister_ms", bench.kubelet_restart, 30 + plan.restarts * 10),
            ("dra_prepare_ms", bench.dra_prepare, 60 + plan.dra_claims * 2),
        ]
        steps = [(key, lambda r=run: bench.timed(r), limit) for key, run, limit in steps]
        for key, run, timeout in steps:
            if key == "discovery_online_flip_ms" and plan.flips == 0:
                results[key] = {"skipped": "not measured in this mode"}
                continue
            await measure(results, key, run, timeout)
    finally:
        try:
            problems = await bench.close()
            setup = results.setdefault("latency_setup", {})
            setup["agent_problems"] = problems[:5] if problems else None
        finally:
            api.stop()


async def scale_section(results: dict[str, Any], plan: ScalePlan, options: AgentOptions) -> None:
    api = ApiServer()
    api.start()
    try:
        timeout = plan.startup_timeout + plan.idle_seconds + 60
        await measure(results, "scale", lambda: run_scale(api, plan, options), timeout)
    finally:
        api.stop()


async def contention_section(
    results: dict[str, Any], plan: ContentionPlan, options: AgentOptions, rng: random.Random
) -> None:
    api = ApiServer()
    api.start()
    try:
        await measure(results, "contention", lambda: run_contention(api, plan, options, rng), 400)
    finally:
        api.stop()


async def controller_section(results: dict[str, Any], plan: ControllerPlan) -> None:
    """``akri controller`` (benchmarks/controller.py), each figure on a fresh API double."""
    import tempfile

    section = results.setdefault("controller", {})
    for key, run, within in (
        ("broker_pod_created_ms", broker_pod_created, 120 + plan.samples * 2),
        ("dead_node_slots_freed_s", dead_node_slots_freed,
         60 + plan.dead_node_samples * (plan.node_grace + 30)),
        ("controller_scale", controller_scale, 1900),
    ):  # fmt: skip
        api = ApiServer()
        api.start()
        try:
            with tempfile.TemporaryDirectory(prefix="akri-bench-controller-") as base:
                await measure(
                    section, key, lambda r=run, a=api, b=base: r(a, plan, Path(b)), within
                )
        finally:
            api.stop()


async def udev_section(results: dict[str, Any], samples: int) -> None:
    """``benchmarks/udev_hotplug.py`` as a subprocess (it needs root and re-executes itself
    under ``umockdev-wrapper``); its figures are merged in, or ``{"skipped": reason}``."""

    async def run_script() -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "benchmarks" / "udev_hotplug.py"),
            "--samples",
            str(samples),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        try:
            parsed: dict[str, Any] = json.loads(out)
        except ValueError:
            raise RuntimeError(f"udev_hotplug.py printed no JSON: {err.decode()[-1000:]}") from None
        if "error" in parsed:
            raise RuntimeError(str(parsed["error"]))
        return parsed

    figures: dict[str, Any] = {}
    await measure(figures, "udev", run_script, 300)
    udev = figures["udev"]
    results.setdefault("load_average_before", {}).update(figures.get("load_average_before", {}))
    if "udev_hotplug_ms" in udev:
        method = udev.pop("method", None)
        results.update(udev)
        results["udev_hotplug_ms"]["method"] = method
    else:  # skipped (no root / no umockdev) or failed: one entry says why
        results["udev_hotplug_ms"] = udev


async def local_section(results: dict[str, Any], plan: LocalPlan) -> None:
    """Local-mode figures (benchmarks/local_mode.py), each with the agent's own loop lag."""
    figures: dict[str, Any] = {}
    await measure(figures, "startup", lambda: measure_startup(plan), 120)
    await measure(figures, "idle", lambda: measure_idle(plan), plan.idle_seconds + 60)
    await measure(figures, "large", lambda: measure_large_instance(plan), 300)
    results.setdefault("load_average_before", {}).update(figures.pop("load_average_before", {}))
    startup, idle, large = figures["startup"], figures["idle"], figures["large"]
    results["startup_first_list_ms"] = startup.get("startup_first_list_ms", startup)
    results["idle_cpu_percent_small"] = idle.get("idle_cpu_percent_small", idle)
    await measure(
        figures,
        "cluster_large",
        lambda: measure_large_instance_cluster(plan.allocations, plan.capacity),
        300,
    )
    cluster_large = figures["cluster_large"]
    await measure(figures, "external", lambda: measure_external_handler(plan.external), 120)
    external = figures["external"]
    results["external_handler_to_instance_ms"] = external.get(
        "external_handler_to_instance_ms", external
    )
    await measure(figures, "mqtt", lambda: measure_mqtt(plan.mqtt_samples, plan.mqtt_retained), 300)
    await measure(figures, "mdns", lambda: measure_mdns(plan.mdns_samples), 120)
    mqtt, mdns = figures["mqtt"], figures["mdns"]
    for key in ("mqtt_announce_to_instance_ms", "mqtt_connect_retained_ms"):
        results[key] = mqtt.get(key, mqtt)
    results["mdns_announce_to_instance_ms"] = mdns.get("mdns_announce_to_instance_ms", mdns)
    await measure(
        figures, "onvif", lambda: measure_onvif(plan.onvif_hello, plan.onvif_cameras), 180
    )
    onvif = figures["onvif"]
    for key in ("onvif_hello_to_instance_ms", "onvif_probe_cycle_ms"):
        results[key] = onvif.get(key, onvif)
    results["allocate_large_instance_ms"] = {
        "local": large.get("allocate_large_instance_ms", large),
        "cluster": cluster_large.get("allocate_large_instance_ms", cluster_large),
    }
    onvif_lags = [
        figure.get("loop_lag_max_ms")
        for figure in (onvif.get("onvif_hello_to_instance_ms"), onvif.get("onvif_probe_cycle_ms"))
        if isinstance(figure, dict)
    ]
    results.setdefault("loop_lag_max_ms", {}).update(
        {
            "local_startup": startup.get("loop_lag_max_ms"),
            "local_idle": idle.get("loop_lag_max_ms"),
            "local_large_instance": large.get("loop_lag_max_ms"),
            "cluster_large_instance": cluster_large.get("loop_lag_max_ms"),
            "external_handler": external.get("loop_lag_max_ms"),
            "mqtt": mqtt.get("loop_lag_max_ms"),
            "mdns": mdns.get("loop_lag_max_ms"),
            "onvif": max((v for v in onvif_lags if v is not None), default=None),
        }
    )


def targets(results: dict[str, Any]) -> dict[str, bool | None]:
    """The project's targets, checked against the figures (None: not measured)."""

    def get(key: str, *path: str) -> Any:
        value: Any = results.get(key)
        for part in path:
            if not isinstance(value, dict) or "error" in value:
                return None
            value = value.get(part)
        return value

    def below(value: Any, limit: float) -> bool | None:
        return None if value is None else value < limit

    return {
        "discovery_p99_below_50ms": below(get("discovery_to_kubelet_ms", "p99"), 50),
        "allocate_il_p99_below_50ms": below(get("allocate_il_ms", "p99"), 50),
        "allocate_cl_p99_below_50ms": below(get("allocate_cl_ms", "p99"), 50),
        "dra_prepare_p99_below_50ms": below(get("dra_prepare_ms", "p99"), 50),
        "udev_hotplug_p99_below_50ms": below(get("udev_hotplug_ms", "p99"), 50),
        "reregistration_p99_below_1s": below(get("kubelet_restart_reregister_ms", "p99"), 1000),
        # issue 17: re-registration stays < 100 ms p99 (the full run restarts with 67 plugins)
        "reregistration_p99_below_100ms": below(get("kubelet_restart_reregister_ms", "p99"), 100),
        "reclaim_p99_below_5s": below(get("reclaim_ms", "p99"), 5000),
        "reclaim_never_frees_a_live_pods_slot": below(get("reclaim_ms", "premature_releases"), 1),
        "rss_below_100mb": below(get("scale", "rss_mb"), 100),
        "idle_cpu_below_1_percent": below(get("scale", "idle_cpu_percent"), 1),
        "idle_api_requests_zero": below(get("scale", "api_requests_idle"), 1),
        "zero_double_allocations": below(get("contention", "double_allocations"), 1),
        # issue 25: the controller
        "broker_pod_created_p99_below_500ms": below(
            get("controller", "broker_pod_created_ms", "p99"), 500
        ),
        "dead_node_slots_freed_within_grace_plus_5s": below(
            get("controller", "dead_node_slots_freed_s", "over_grace_max_s"), 5
        ),
        "zero_leaked_slots": below(get("contention", "final_leaked_slots"), 1),
        "startup_first_list_below_150ms": below(get("startup_first_list_ms", "p50"), 150),
        "idle_cpu_small_below_0_1_percent": below(get("idle_cpu_percent_small"), 0.1),
        "allocate_large_instance_local_p99_below_20ms": below(
            get("allocate_large_instance_ms", "local", "p99"), 20
        ),
        "allocate_large_instance_local_max_below_50ms": below(
            get("allocate_large_instance_ms", "local", "max"), 50
        ),
        "allocate_large_instance_cluster_p99_below_20ms": below(
            get("allocate_large_instance_ms", "cluster", "p99"), 20
        ),
        "allocate_large_instance_cluster_max_below_50ms": below(
            get("allocate_large_instance_ms", "cluster", "max"), 50
        ),
        "external_handler_p99_below_50ms": below(get("external_handler_to_instance_ms", "p99"), 50),
        # issue 14: an announcement becomes an Instance in well under a discovery cycle
        "mqtt_announce_p99_below_100ms": below(get("mqtt_announce_to_instance_ms", "p99"), 100),
        "mdns_announce_p99_below_100ms": below(get("mdns_announce_to_instance_ms", "p99"), 100),
        # issue 13: Hello → Instance p99 < 100 ms; 50 cameras within discoveryTimeout + 1 s
        "onvif_hello_p99_below_100ms": below(get("onvif_hello_to_instance_ms", "p99"), 100),
        "onvif_probe_cycle_within_timeout_plus_1s": below(
            get("onvif_probe_cycle_ms", "ms"),
            (get("onvif_probe_cycle_ms", "discovery_timeout_s") or 0) * 1000 + 1000,
        )
        if get("onvif_probe_cycle_ms", "ms") is not None
        else None,
        # sections that did not run (skipped: no mosquitto, no multicast) report None
        "loop_lag_below_10ms": None
        if not any(v is not None for v in results.get("loop_lag_max_ms", {}).values())
        else all(v < 10 for v in results["loop_lag_max_ms"].values() if v is not None),
    }


async def run(args: argparse.Namespace, results: dict[str, Any]) -> None:
    mode = "quick" if args.quick else "full"
    plans = PLANS[mode]
    options = AgentOptions(extra_args=tuple(args.agent_arg), logs_dir=args.logs)
    rng = random.Random(args.seed)
    results["mode"] = mode
    results["env"] = environment()
    results["settings"] = {
        "agent": asdict(options),
        "plans": {name: asdict(plan) for name, plan in plans.items() if name in args.only},
        "seed": args.seed,
    }
    lags = results.setdefault("loop_lag_max_ms", {})

    def record_lag(section: str, mark: int) -> None:
        seen = LOOP_LAGS[mark:]
        lags[section] = max(seen) if seen else None

    if "latency" in args.only:
        mark = len(LOOP_LAGS)
        await latency_section(results, plans["latency"], options, rng)
        record_lag("latency", mark)
    if "scale" in args.only:
        mark = len(LOOP_LAGS)
        await scale_section(results, plans["scale"], options)
        record_lag("scale", mark)
    if "contention" in args.only:
        mark = len(LOOP_LAGS)
        await contention_section(results, plans["contention"], options, rng)
        record_lag("contention", mark)
    if "many_agents" in args.only:
        plan = plans["many_agents"]
        within = len(plan.agents) * (3 * plan.within + 120)
        await measure(results, "many_agents", lambda: run_many_agents(plan, options), within)
    if "fleet" in args.only:
        fleet = plans["fleet"]
        within = 4 * fleet.within + 3 * fleet.seconds + 60 * len(fleet.sizes)
        await measure(results, "fleet", lambda: run_fleet(fleet, fleet_options(options)), within)
    if "controller" in args.only:
        await controller_section(results, plans["controller"])
    if "udev" in args.only:
        await udev_section(results, UDEV_SAMPLES[mode])
    if "local" in args.only:
        await local_section(results, plans["local"])
    if "peer" in args.only:
        await peer_section(results, PEER_PLANS[mode], args.peer_bin)


async def peer_section(results: dict[str, Any], plan: PeerPlan, binary: Path | None) -> None:
    """Our local agent and the Go peer, alternating (benchmarks/peer.py); a table on stderr."""
    within = plan.rounds * (2 * plan.idle_seconds + 2 * plan.settle_seconds + 300)
    await measure(results, "peer", lambda: run_peer(binary, plan), within)
    log("side by side with the Go peer:\n" + table(results["peer"]))


async def amain(args: argparse.Namespace, results: dict[str, Any]) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await run(args, results)
    finally:
        PROCESSES.kill_all()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    results: dict[str, Any] = {}
    started = time.monotonic()
    interrupted = False
    try:
        asyncio.run(amain(args, results))
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
        results["interrupted"] = True
    finally:
        PROCESSES.kill_all()
    results["duration_s"] = round(time.monotonic() - started, 1)
    results["targets"] = targets(results)
    failed = sorted(k for k, v in results.items() if isinstance(v, dict) and "error" in v)
    results["failed"] = failed
    text = json.dumps(results, indent=2, default=str)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
