"""Failpoints: named places in the workers where a fault can be made to happen at an exact
state of a request (Reserve granted, push about to be posted, a spill under way ...) instead
of at a moment a test guesses. `pdserve bench chaos` and the fault tests use them; a
worker started without `--failpoints DIR` has none (every hit is one attribute test).

A failpoint is armed from outside the process by a file, `DIR/<pid>.<point>` for one
process or `DIR/any.<point>` for whichever process gets there first, holding one line,
`ACTION [SECONDS] [repeat]`. The first hit claims it (renamed to `.claimed`: one thread of
one process wins), writes `DIR/<target>.<point>.fired` (its first line the pid that hit it,
then the hit's detail, for instance the request id: the bench reads it to pick whom to
cancel or which peer to strike), then acts:

    kill        SIGKILL this process (no clean-up runs, as in a crash)
    stop        SIGSTOP this process (whoever armed it sends SIGCONT)
    pause S     sleep S seconds in the thread that hit it (a stalled push, a slow tier)
    error       hit() returns "error" and the caller raises what that place raises when
                its resource fails (the disk tier: ENOSPC, a full file system); only the
                points in FAILING have such a caller, and arm() refuses it elsewhere

`repeat` keeps it armed (every hit acts; the marker is written once) until the file is
removed. Points (docs/faults.md has the list with what each state means):

    decode.reserve   a Reserve granted, before it is answered (detail: request id)
    decode.stream    a stream's fourth token handed to the client (request id)
    decode.feed      a caller's feed about to send a step's batch (feed id); `error` ends
                     the feed call UNAVAILABLE, as a cut connection would, the worker alive
    decode.migrate   a live migration's last round about to stop the request on the worker
                     it leaves (request id; decode/migrate.py)
    decode.step      the decode step loop about to plan a step (outside the worker's lock):
                     `pause S repeat` makes every step S seconds longer, so that streams
                     outlast what a test does while they run
    prefill.accept   a Prefill call accepted, before it queues (request id)
    prefill.push     before a batch's first WRITE is posted: after its forward pass, or
                     with layer-wise pushes (CUDA) after its first layer (one line per
                     request: "request-id destination-worker-id")
    prefill.posted   the batch's first WRITEs posted, in flight (same detail)
    kv.spill         a preempted request's KV about to be spilled (request id)
    kv.reload        a parked request's KV about to be reloaded (request id)
    disk.write       the disk tier's writer about to write a piece of an entry (file path)

This module imports nothing of ours: every layer (the tiers too) may take a Failpoints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

ACTIONS = ("kill", "stop", "pause", "error")
FAILING = frozenset({"disk.write", "decode.feed"})  # the points whose caller fails on "error"
POINTS = (
    "decode.reserve",
    "decode.stream",
    "decode.feed",
    "decode.migrate",
    "decode.step",
    "prefill.accept",
    "prefill.push",
    "prefill.posted",
    "kv.spill",
    "kv.reload",
    "disk.write",
)


@dataclass(frozen=True)
class Failpoints:
    """The failpoints of one process: armed by files in `directory` (None: none ever)."""

    directory: str | None = None

    def hit(self, point: str, detail: str = "") -> str | None:
        """Act on `point` if it is armed -> "error" when the caller is to fail, else None."""
        if self.directory is None:
            return None
        assert point in POINTS, f"unknown failpoint {point!r}"
        for target in (str(os.getpid()), "any"):
            path = os.path.join(self.directory, f"{target}.{point}")
            try:
                with open(path) as f:
                    words = f.read().split()
            except OSError:
                continue  # not armed (the common case: one failed open)
            return _act(path, point, words, detail)
        return None


def _parse(point: str, words: list[str]) -> tuple[str, float, bool]:
    """-> (action, pause seconds, repeat); ValueError naming what is wrong."""
    action, args = (words[0], words[1:]) if words else ("", [])
    if action not in ACTIONS:
        raise ValueError(f"failpoint action: {' '.join(words)!r} is not one of {ACTIONS}")
    if action == "error" and point not in FAILING:
        raise ValueError(f"failpoint action: only {', '.join(sorted(FAILING))} can fail")
    repeat = bool(args) and args[-1] == "repeat"
    args = args[:-1] if repeat else args
    seconds = 1.0
    if action == "pause" and args:
        try:
            seconds = float(args[0])
        except ValueError:
            raise ValueError(f"failpoint action: pause takes seconds, got {args[0]!r}") from None
        args = args[1:]
    if args or not seconds >= 0:
        raise ValueError(f"failpoint action: {' '.join(words)!r} is not ACTION [SECONDS] [repeat]")
    return action, seconds, repeat


def _act(path: str, point: str, words: list[str], detail: str) -> str | None:
    action, seconds, repeat = _parse(point, words)
    if not repeat:
        try:
            os.rename(path, f"{path}.claimed")
        except OSError:
            return None  # another thread (or process) claimed it first
    _mark(f"{path}.fired", f"{os.getpid()}\n{detail}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "pause":
        time.sleep(seconds)
    return "error" if action == "error" else None


NO_FAILPOINTS = Failpoints()


def _mark(path: str, detail: str) -> None:
    """Write the marker whole or not at all (the reader polls for it), once: a hard link
    of a finished file, which fails if a concurrent hit made it first."""
    if os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(detail)
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)
    os.unlink(tmp)


def arm(directory: str, target: int | str, point: str, action: str) -> None:
    """Arm `point` in process `target` (a pid, or "any": the first to get there); the
    marker of an earlier arm of it goes."""
    if point not in POINTS:
        raise ValueError(f"failpoint: {point!r} is not one of {', '.join(POINTS)}")
    _parse(point, action.split())
    path = os.path.join(directory, f"{target}.{point}")
    for leftover in (f"{path}.fired", f"{path}.claimed"):  # of an earlier arm
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(action)
    os.replace(tmp, path)  # the worker never reads half an action


def disarm(directory: str, target: int | str, point: str) -> None:
    """Remove the arm of `point` if it has not fired (a repeat one stops)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, f"{target}.{point}"))


def fired(directory: str, target: int | str, point: str) -> tuple[int, str] | None:
    """(the pid that hit it, the hit's detail) once `point` fired, else None."""
    try:
        with open(os.path.join(directory, f"{target}.{point}.fired")) as f:
            pid, _, detail = f.read().partition("\n")
    except FileNotFoundError:
        return None
    return int(pid), detail
