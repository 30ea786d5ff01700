"""tfremat internals: planning."""

__all__ = []
