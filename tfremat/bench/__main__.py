"""`python -m tfremat.bench`: see `tfremat.bench`."""

from absl import app

from tfremat.bench import cli

__all__ = []

if __name__ == "__main__":
  cli.define_flags()
  app.run(cli.main, flags_parser=cli.parse_flags)
