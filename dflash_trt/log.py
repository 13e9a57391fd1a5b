"""Progress, status and waiting lines: stderr, so a command's stdout carries only its product (generated text, a
benchmark's table) and `dflash-trt generate ... > out.txt` gets the text alone."""
from __future__ import annotations

import sys


def progress(*parts, end: str = "\n") -> None:
    """print() to stderr, flushed (a line of a long export or build shows as it happens)."""
    print(*parts, end=end, file=sys.stderr, flush=True)
