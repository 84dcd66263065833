"""Processes that die with their parent, however the parent dies.

The parent starts the child with `child_env(env, os.getpid())` in its environment; the
child calls `adopt()` first thing: it asks the kernel for SIGTERM when that parent dies
(PR_SET_PDEATHSIG), then checks that the parent is still the one it was started by (had it
died before the call, nobody would signal us: the child exits). The launcher's children and
the tensor-parallel ranks a role starts are made this way.

The request is made by the child, after exec, not by a `preexec_fn` in the parent: a
`preexec_fn` makes Python fork() the whole multi-threaded parent (gRPC, NIXL and torch
threads) and run its at-fork handlers, and gRPC's restarted its poller in the child, which
then died with SIGABRT before exec ("epoll_wait error: Bad file descriptor"; grpc/grpc PR
#43157 describes the same crash). Without one, Python starts the child with vfork and no
handlers run. Linux only: elsewhere adopt() does nothing and the parent's close() still
stops its children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_ENV = "PDSERVE_DIE_WITH"  # the pid of the process the child must not outlive


def child_env(env: Mapping[str, str], parent: int) -> dict[str, str]:
    """`env` for a child that must die with `parent` (it calls adopt())."""
    return {**env, PARENT_ENV: str(parent)}


def adopt() -> None:
    """In a child started with child_env(): get SIGTERM when the parent dies, however it
    dies (a SIGKILL leaves it no chance to run close()); exit at once if it is gone already.
    The variable is taken out of our environment: our own children get their own."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the call: nobody would signal us
        os._exit(1)
