"""Running a process in production: health and readiness, Prometheus metrics, JSON logs, GC
tuning and the event-loop monitor. Used by the node agent and the controller alike; imports
only ``agent.core`` (never ``agent.node`` or ``agent.controller``)."""
