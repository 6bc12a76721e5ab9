"""farm.controller."""
