"""Units for printouts: bytes as MiB."""

__all__ = ["format_bytes"]


def format_bytes(num_bytes):
  """Bytes as MiB with one decimal, e.g. '79.0 MiB'."""
  return f"{num_bytes / 2**20:.1f} MiB"
