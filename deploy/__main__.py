"""``python -m deploy``: see :mod:`deploy.cli`."""

import sys

from deploy.cli import main

sys.exit(main())
