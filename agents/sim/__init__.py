"""farm.agents.sim."""
