"""Rewrite NIXL wheels without the parts kvbridge never imports, for a GPU host that gets
its wheels in one small folder (``scripts/gpu_wheels.sh``).

nixl-cu13 1.5.1 (59 MB) carries ``nixl_ep_cu13``, NIXL's expert-parallel extensions: 90 MiB
unpacked, 26 MiB of the wheel. kvbridge imports ``nixl._api`` and the bindings only. Each
wheel named on the command line is rewritten in place without the top-level folders in
``DROP`` (and their lines in the wheel's ``RECORD``); a wheel without them is left as it
was::

    python scripts/slim_nixl_wheel.py .whl/nixl_cu13-*.whl
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

DROP = ("nixl_ep_cu12", "nixl_ep_cu13")  # top-level folders of the wheel left out


def _dropped(name: str) -> bool:
    return name.split("/", 1)[0] in DROP


def slim(wheel: Path) -> int:
    """Rewrite ``wheel`` without ``DROP``; the bytes it saves (0: nothing to drop)."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        if not any(_dropped(i.filename) for i in infos):
            return 0
        fd, tmp = tempfile.mkstemp(suffix=".whl", dir=wheel.parent)
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in infos:
                    if _dropped(info.filename):
                        continue
                    data = src.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(ln for ln in lines if not _dropped(ln)).encode()
                    dst.writestr(info, data)
        except BaseException:
            os.unlink(tmp)
            raise
    before = wheel.stat().st_size
    os.chmod(tmp, wheel.stat().st_mode)
    os.replace(tmp, wheel)
    return before - wheel.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for wheel in args.wheels:
        saved = slim(wheel)
        what = f"{saved / 2**20:.1f} MiB smaller" if saved else "nothing to drop"
        print(f"{wheel.name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
