"""`python -m pagedjax.cli`: the same as `python -m pagedjax` and the `pagedjax-generate` console script."""

import sys

from pagedjax.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
