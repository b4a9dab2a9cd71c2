"""``python -m cupy_merge``: the self-check (:mod:`cupy_merge.tools.selfcheck`)."""

import sys

from .tools.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
