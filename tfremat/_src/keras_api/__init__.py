"""tfremat internals: keras_api."""

__all__ = []
