"""Instance stores: one interface, a local (file) backend and a Kubernetes backend."""
