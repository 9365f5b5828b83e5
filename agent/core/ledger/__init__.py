"""The per-node slot ledger: pure slot decisions and the CAS loop that applies them."""
