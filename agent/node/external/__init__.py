"""External discovery handlers over Akri's ``v0`` discovery protocol (both directions)."""
