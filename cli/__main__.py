"""``python -m kvbridge.cli``: the ``kvbridge`` command."""

import sys

from kvbridge.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
