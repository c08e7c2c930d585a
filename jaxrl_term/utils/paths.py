"""Where the project's shared/ folder is (datasets, references: read there, never copied into the repository)."""

from __future__ import annotations

import os
from pathlib import Path

_BESIDE = Path(__file__).resolve().parents[2].parent / "shared"


def shared_dir() -> Path:
    """``$JAXRL_TERM_SHARED``, else ``shared/`` beside the checkout, else ``/work/shared`` (the first that exists;
    else the one beside the checkout, for error messages)."""
    for c in (os.environ.get("JAXRL_TERM_SHARED"), _BESIDE, "/work/shared"):
        if c and Path(c).is_dir():
            return Path(c)
    return _BESIDE


def shared_path(rel: str) -> str:
    """``${shared:datasets/...}`` in configs: a path under shared/, independent of the working directory."""
    return str(shared_dir() / rel)
