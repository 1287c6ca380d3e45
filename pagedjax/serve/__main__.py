"""`python -m pagedjax.serve`: the same as the `pagedjax-serve` console script."""

import sys

from pagedjax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
