"""Fixtures shared by the e2e modules: `demo_prepared` lives in tests/conftest.py (unit tests read it too)."""
