"""``python -m cupy_merge.bench``: the benchmark (:mod:`cupy_merge.tools.bench`)."""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
