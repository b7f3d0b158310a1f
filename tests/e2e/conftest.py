"""The e2e fixtures live in tests/conftest.py so that one cluster serves every test module."""
