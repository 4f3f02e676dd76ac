"""`python -m kvfence_engine.native DIR`: build every native kernel into DIR (an image's build;
the image then sets KVFENCE_NATIVE_DIR=DIR and needs no compiler; $CC names the compiler)."""

import os
import sys
from pathlib import Path

from kvfence_engine.native import build_all

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvfence_engine.native DIR")
    for path in build_all(Path(sys.argv[1]), os.environ.get("CC", "cc")):
        print(path)
