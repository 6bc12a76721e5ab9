"""farm's version, in a module of its own: every role may import it without importing the `farm`
package's Python API (farm/__init__.py)."""

__version__ = "0.1.0"
