"""farm.agents.link."""
