"""``python -m kareus``: the command line (see :mod:`kareus.cli`)."""

import sys

from kareus.cli import main

sys.exit(main())
