"""``python -m weightsync``: the ``weightsync`` command, where the console script is not on PATH."""

import sys

from .cli import main

sys.exit(main())
