"""Runs one stage: `python HARNESS_DIR/kforge_harness` (see `kforge_harness.modes.main`).

Python puts this package's folder first on sys.path; its parent, the harness directory (where kforge_nvcc.py lies),
takes its place, so that sys.path reads as when the harness was one file there and the package imports as itself.
"""

import os
import sys

_package = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _package:
    sys.path[0] = os.path.dirname(_package)
else:
    sys.path.insert(0, os.path.dirname(_package))

from kforge_harness.modes import main  # noqa: E402

if __name__ == "__main__":
    main()
