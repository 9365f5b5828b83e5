"""``akri agent`` with profiling hooks, for ``benchmarks/profile_scale.py`` (not for the
figures: profiling slows the agent down).

    python benchmarks/profiled_agent.py OUT_DIR [--tracemalloc] [--profile-startup] -- ARGS

* ``--profile-startup``: cProfile runs from the start until the first SIGUSR2;
* SIGUSR1 starts cProfile, SIGUSR2 stops it and writes ``OUT_DIR/cpu-<k>.txt`` (pstats sorted
  by own time and by cumulative time);
* ``--tracemalloc``: allocations are traced from the start; every SIGUSR2 also writes
  ``OUT_DIR/mem-<k>.txt`` (top allocation sites and traced total);
* ``--gc-log``: every garbage collection of 5 ms or more is appended to ``OUT_DIR/gc.txt``
  (monotonic time, generation, milliseconds, objects collected);
* ``--gc-freeze-after=S``: ``gc.collect(); gc.freeze()`` S seconds after the start, from a
  helper thread (an experiment for the suggested fix of the GC pauses, see
  docs/performance.md).
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import signal
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Hooks:
    def __init__(self, out: Path, *, startup: bool, trace_memory: bool) -> None:
        self.out = out
        self.count = 0
        self.profile: cProfile.Profile | None = None
        self.trace_memory = trace_memory
        if trace_memory:
            tracemalloc.start(4)
        if startup:
            self.start()

    def start(self, *_: object) -> None:
        if self.profile is None:
            self.profile = cProfile.Profile()
            self.profile.enable()

    def dump(self, _signum: int = 0, _frame: FrameType | None = None) -> None:
        self.count += 1
        if self.profile is not None:
            self.profile.disable()
            text = io.StringIO()
            stats = pstats.Stats(self.profile, stream=text)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(60)
            (self.out / f"cpu-{self.count}.txt").write_text(text.getvalue())
            self.profile = None
        if self.trace_memory:
            snapshot = tracemalloc.take_snapshot()
            current, peak = tracemalloc.get_traced_memory()
            lines = [f"traced: current {current / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"]
            lines.append("\n-- top 40 by file --")
            for stat in snapshot.statistics("filename")[:40]:
                lines.append(str(stat))
            lines.append("\n-- top 40 by line --")
            for stat in snapshot.statistics("lineno")[:40]:
                lines.append(str(stat))
            lines.append("\n-- top 15 by traceback --")
            for stat in snapshot.statistics("traceback")[:15]:
                lines.append(f"{stat.size / 2**20:.2f} MiB in {stat.count} blocks")
                lines.extend("    " + line for line in stat.traceback.format()[-12:])
            (self.out / f"mem-{self.count}.txt").write_text("\n".join(lines) + "\n")


def log_gc_pauses(path: Path, threshold: float = 0.005) -> None:
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= threshold:
            with open(path, "a") as handle:
                handle.write(
                    f"{time.monotonic():.3f} gen{info['generation']} {took * 1000:.1f} ms "
                    f"collected={info['collected']}\n"
                )

    gc.callbacks.append(callback)


def freeze_after(seconds: float) -> None:
    def run() -> None:
        time.sleep(seconds)
        gc.collect()
        gc.freeze()

    threading.Thread(target=run, name="gc-freeze", daemon=True).start()


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    own, agent_args = argv[:split], argv[split + 1 :]
    out = Path(own[0])
    out.mkdir(parents=True, exist_ok=True)
    hooks = Hooks(out, startup="--profile-startup" in own, trace_memory="--tracemalloc" in own)
    if "--gc-log" in own:
        log_gc_pauses(out / "gc.txt")
    signal.signal(signal.SIGUSR1, hooks.start)
    signal.signal(signal.SIGUSR2, hooks.dump)
    for option in own:
        if option.startswith("--gc-freeze-after="):
            freeze_after(float(option.split("=", 1)[1]))
    from agent.cli import main as akri_main

    return akri_main(["agent", *agent_args])


if __name__ == "__main__":
    sys.exit(main())
