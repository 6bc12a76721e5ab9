"""farm.agents.android."""
