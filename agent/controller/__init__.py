"""The cluster-wide controller (``akri controller``): broker workloads, dead nodes' slots and
the cluster-scoped objects no single node should own. May import ``agent.core`` and
``agent.ops``; never ``agent.node``."""
