"""``python -m kareus.cli``: the command line."""

import sys

from kareus.cli import main

sys.exit(main())
