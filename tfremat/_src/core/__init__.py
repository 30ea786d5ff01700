"""tfremat internals: core."""

__all__ = []
