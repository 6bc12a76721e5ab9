"""farm.agents."""
