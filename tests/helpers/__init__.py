"""Test helpers shared by the agent's tests (and any test that needs a job without services)."""
