import sys

from kvbridge.cli.main import main

sys.exit(main())
