"""Where a local cluster's CPU lease lives on its node, and how it goes away.

    path, owner = make_lease_dir()        # /dev/shm/pdserve-cpus-<launcher pid>-XXXX
    ... workers open CpuLease(path + "/cpu") ...
    shutil.rmtree(path); owner.close()    # the launcher's close()

A launcher killed by SIGKILL never runs its close(); the next launch on the node removes
the directory it left once nobody uses it (`remove_orphaned`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from typing import IO

from pdserve.serving.cpu_lease import is_locked

PREFIX = "pdserve-cpus-"
OWNER = "launcher"  # the file the launcher holds locked while its cluster lives
ORPHAN_AGE_S = 60.0  # a lease directory younger than this is never judged orphaned


def make_lease_dir(shm: str = "/dev/shm") -> tuple[str, IO[str]]:
    """A fresh directory for a cluster's CPU lease -> (its path, the open owner file that
    the launcher holds locked until it closes it). Memory-backed where the machine has it
    (the lease's state is read at every turn), else the temporary directory."""
    where = shm if os.access(shm, os.W_OK) else tempfile.gettempdir()
    remove_orphaned(where)
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=where)
    owner = open(os.path.join(path, OWNER), "w")  # noqa: SIM115 - held until close()
    fcntl.flock(owner, fcntl.LOCK_EX)
    return path, owner


def remove_orphaned(where: str, min_age_s: float = ORPHAN_AGE_S) -> None:
    """Removes the lease directories in `where` that nobody uses: the launcher pid in the
    name is not running here, no file in it is locked (the launcher holds its owner file,
    every worker the file of its slot: flock holds across pid namespaces, where a launcher
    in another container sharing /dev/shm has a pid we cannot see), and it is older than
    `min_age_s` (a launcher may not have locked its owner file yet)."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    now = time.time()
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not (name.startswith(PREFIX) and pid.isdigit()) or _running(int(pid)):
            continue  # not ours (or from before names held a pid), or its launcher runs
        path = os.path.join(where, name)
        try:
            if now - os.stat(path).st_mtime < min_age_s or any(
                is_locked(os.path.join(path, f)) for f in os.listdir(path)
            ):
                continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process `pid` exists here (another user's counts: not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
