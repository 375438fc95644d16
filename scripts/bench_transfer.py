"""Moved to ``kvbridge bench transfer`` (``kvbridge.cli.bench.transfer``);
this shim, and the module's names read from here, stay for one release."""

import sys

from kvbridge.cli.bench import transfer as _moved


def __getattr__(name: str) -> object:
    return getattr(_moved, name)


if __name__ == "__main__":
    sys.exit(_moved.main())
