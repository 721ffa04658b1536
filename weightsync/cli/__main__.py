"""Internal. ``python -m weightsync.cli``: the ``weightsync`` command (cli/__init__.py)."""

import sys

from . import main

sys.exit(main())
