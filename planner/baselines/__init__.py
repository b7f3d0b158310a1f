"""Baseline policies behind the same `plan()` interface, so every comparison runs on the same work."""
