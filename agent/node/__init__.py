"""The per-node agent (the DaemonSet): discovery, device plugins, DRA, external handlers.

``app`` wires one node's parts; ``discovery`` turns handler device lists into Instances;
``deviceplugin`` and ``dra`` offer the slots to kubelet; ``external`` speaks Akri's discovery
protocol; ``kubelet`` reads what kubelet already uses (pod-resources, its checkpoint). May import
``agent.core``, ``agent.ops``, ``agent.protos`` and ``discovery_handlers``; never the controller.
"""
