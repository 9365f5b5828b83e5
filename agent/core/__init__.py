"""The shared core: what the node agent and the controller both stand on.

``model`` (Akri's data: names, deviceUsage values, Configuration, Instance, properties),
``kube`` (the Kubernetes REST client), ``store`` (the Instance store: local files or the API
server, CAS writes, informer caches, Configuration files), ``ledger`` (the slot rules and the only
writer of ``deviceUsage``), ``aio`` (asyncio kits: event fan-out, inotify) and ``telemetry``
(plain counters). Imports nothing from ``agent.node``, ``agent.controller`` or ``agent.ops``.
"""
