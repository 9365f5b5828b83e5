"""Tests of ``akri controller`` (agent/controller/): pure broker, Service and dead-node
decisions, and the controller against the API-server double (brokers, Services, dead nodes,
leader election with real processes)."""
