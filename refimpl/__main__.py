"""`python -m refimpl ...`: the `refimpl` command."""

import sys

from .cli import main

sys.exit(main())
