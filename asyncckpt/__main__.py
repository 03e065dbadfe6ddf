"""``python -m asyncckpt``: the same command line as the ``asyncckpt`` script."""

import sys

from asyncckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
