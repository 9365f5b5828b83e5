"""Discovery handlers: the handler interface and the embedded handlers."""
