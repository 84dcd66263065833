"""Processes that die with their parent, however the parent dies.

`die_with(parent)` is a `preexec_fn` for subprocess: the launcher's children, the tensor
parallel ranks a role starts. Linux only: elsewhere it does nothing and the parent's
close() still stops its children.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies, however it dies (a SIGKILL
    leaves no chance to run close()). Linux only; elsewhere None (close() still stops it).
    libc is loaded here, in the parent: the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return functools.partial(_set_parent_death_signal, prctl, parent)


def _set_parent_death_signal(prctl, parent: int) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the call: nobody would signal us
        os._exit(1)
