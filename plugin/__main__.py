"""``python -m plugin``: the command line, :mod:`plugin.cli.main`."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
