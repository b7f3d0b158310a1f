"""Thin Kubernetes client helpers, one verb per module (kopf's layout): connecting, watching,
patching, posting events, holding a lease. Objects travel as plain dicts, as the API serves
them, so the pure code above never depends on the client's model classes."""
