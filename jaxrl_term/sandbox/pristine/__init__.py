"""Programs that run *inside* a sandbox with the task image's own Python (never imported on the host):

* ``probe.py``: at snapshot time, in a one-shot container of the pristine image (before any agent runs), copies
  the interpreter, its stdlib, lib-dynload, the shared libraries they load, the dynamic loader and pytest with
  its dependencies into the toolchain volume, and reports what the tamper checks need to know about the image.
* ``validate.py``: then, through the copy, checks that nothing outside the volume is loaded and warms its
  bytecode cache.
* ``runner.py``: at verification, reads a nonce from stdin, runs pytest, and writes the results tagged with the
  nonce to the exec's own stdout.

They are passed as ``python -c <source>``: Python 3.8+ syntax, standard library only.
"""

from pathlib import Path


def source(name: str) -> str:
    return (Path(__file__).with_name(name)).read_text()
