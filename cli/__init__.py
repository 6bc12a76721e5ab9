"""farm.cli."""
