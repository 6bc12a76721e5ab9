"""farm.proto."""
