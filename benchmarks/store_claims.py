"""The local store's share of an Allocate (issue 27): ``SlotLedger.claim`` of distinct slots
of one Instance of capacity 1000 on a ``LocalInstanceStore``, in this process (no gRPC, no
device plugin), each claim a resourceVersion-checked durable write.

    python benchmarks/store_claims.py [--claims 300]

Prints p50/p99 in ms. For an A/B, run it with ``PYTHONPATH`` pointing at another source tree
(from outside the checkout, e.g. ``cd /tmp``), alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey

NAME = "big-abcdef"
KEY = ObjectKey("default", NAME)


async def measure(claims: int, capacity: int = 1000) -> list[float]:
    from agent.core.store.local import LocalInstanceStore

    with tempfile.TemporaryDirectory(dir="/tmp") as state:
        store = LocalInstanceStore(Path(state), poll_interval=1.0)
        await store.start()
        try:
            usage = {f"{NAME}-{i}": "" for i in range(capacity)}
            await store.create(
                Instance(NAME, "big", capacity, shared=True, nodes=("n",), device_usage=usage)
            )
            ledger = SlotLedger(store, "n")
            owner = Owner.instance_level("n")
            samples = []
            for slot in range(claims):
                started = time.perf_counter()
                await ledger.claim(KEY, f"{NAME}-{slot}", owner)
                samples.append((time.perf_counter() - started) * 1000)
            return samples
        finally:
            await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=300)
    args = parser.parse_args(argv)
    samples = sorted(asyncio.run(measure(args.claims)))
    p50 = samples[len(samples) // 2]
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    print(f"p50 {p50:.2f} p99 {p99:.2f} ms (n {len(samples)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
