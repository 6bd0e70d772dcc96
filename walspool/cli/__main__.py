"""``python -m walspool.cli``: the ``walspool`` command."""

import sys

from . import main

sys.exit(main())
