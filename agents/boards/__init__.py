"""farm.agents.boards."""
