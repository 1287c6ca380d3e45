"""`python -m pagedjax`: the same as the `pagedjax-generate` console script."""

import sys

from pagedjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
