"""Ending a pagoda process without the interpreter's teardown."""
from __future__ import annotations

import atexit
import os
import sys


def exit_without_teardown(code: int) -> None:
    """End the process now: the ``atexit`` handlers run (logging, multiprocessing's children, a
    tensor-parallel executor's workers), the standard streams are flushed, and nothing else. The
    teardown of a process holding torch, Triton and transformers only printed extension modules'
    leak reports and took about a second of every server stop."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
