"""farm.agents.harness."""
