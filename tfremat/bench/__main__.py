"""`python -m tfremat.bench`: see `tfremat.bench`."""

from absl import app
from absl import flags

import tfremat.bench
from tfremat.bench import cli

__all__ = []

if __name__ == "__main__":
  # What --help prints: the package's description, then the bench's flags
  # (absl lists the main module's own flags, and the bench defines its
  # flags in cli).
  __doc__ = tfremat.bench.__doc__  # pylint: disable=redefined-builtin
  cli.define_flags()
  flags.adopt_module_key_flags(cli)
  app.run(cli.main, flags_parser=cli.parse_flags)
