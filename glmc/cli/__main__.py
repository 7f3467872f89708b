"""``python -m glmc.cli``: the ``glmc`` command."""

import sys

from glmc.cli.main import main

sys.exit(main())
