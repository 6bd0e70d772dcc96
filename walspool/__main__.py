"""``python -m walspool``: the ``walspool`` command."""

import sys

from .cli import main

sys.exit(main())
