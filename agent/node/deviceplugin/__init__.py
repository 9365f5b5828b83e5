"""Kubelet device plugins (v1beta1): instance-level and configuration-level, one slot pool."""
