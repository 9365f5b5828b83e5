"""What this node's kubelet already knows: pod-resources ``List``, its device-manager
checkpoint (``state``), and the evidence built from them (and the DRA checkpoint) before any
slot is freed, re-created or adopted (``evidence``)."""
