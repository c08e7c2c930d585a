"""Command-line boundaries: bad input ends with one clear line and exit code 2, never a traceback.

``guard(main)(argv)`` runs an entry point; errors that describe the user's input (missing files, bad task or
model directories, bad config values: ``ValueError`` and its many subclasses here, ``OSError`` for paths) print
``error: <message>`` on stderr and exit 2. ``JAXRL_TERM_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                                PermissionError)


def guard(main: Callable[..., int | None]) -> Callable[..., int]:
    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except USER_ERRORS as e:
            if os.environ.get("JAXRL_TERM_DEBUG"):
                raise
            msg = str(e).strip() or type(e).__name__
            if isinstance(e, OSError) and e.filename:
                msg = f"{e.filename}: {e.strerror or msg}"
            print(f"error: {msg}", file=sys.stderr)
            return 2

    return wrapped
