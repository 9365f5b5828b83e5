"""Harnesses that assemble the agent for tests: real ``akri`` subprocesses (``agent_process``),
simulated nodes with device plugins (``dp_nodes``) or with the discovery manager only
(``k8s_nodes``)."""
