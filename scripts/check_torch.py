"""Fail when the installed torch is not the one the Makefile asked for.

Usage: ``python scripts/check_torch.py torch==2.13.0``. A dependency that pulls another torch
(a CUDA build, a newer release) would otherwise make the tests run against a torch nobody
chose.
"""

from __future__ import annotations

import sys

import torch


def main(spec: str) -> int:
    wanted = spec.partition("==")[2].strip()
    have = torch.__version__.split("+")[0]
    if wanted and have != wanted:
        print(f"check_torch: installed torch {torch.__version__}, asked for {spec}", file=sys.stderr)
        return 1
    print(f"check_torch: torch {torch.__version__} as asked ({spec})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
