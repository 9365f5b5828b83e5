"""Tests of ``agent/core/kube``: the REST client, kubeconfig, proxies, real-world clusters."""
