"""How each fault of pdserve/bench/faults.py strikes a launched cluster during a phase of
`bench chaos`: arm it (a failpoint in the workers, pdserve/failpoints.py), watch for it to
fire, react (strike the peer, cancel the request, corrupt the spill files), and undo what
must be undone (SIGCONT, closing a socket) at its time.

    strike = Strike.arm(fault, cluster, failpoint_dir, spill_root)
    while load runs:  strike.poll(load)     # fires / reacts / undoes when due
    strike.finish()                          # disarm what never fired, undo the rest

Faults with no state (router-restart, black-hole, cancel, prefill-*@stream) strike at a
moment instead: once half of the concurrent streams have their first token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

from pdserve import failpoints
from pdserve.bench.faults import PAUSE_S, STOP_S
from pdserve.bench.probes import busiest, registered, spill_dirs, spill_files
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.drain import drained

# fault state -> the failpoint that marks it (pdserve/failpoints.py names where each sits)
POINT = MappingProxyType(
    {
        "reserve": "decode.reserve",
        "stream": "decode.stream",
        "spill": "kv.spill",
        "reload": "kv.reload",
        "accept": "prefill.accept",
        "push": "prefill.push",
        "posted": "prefill.posted",
        "migrate": "decode.migrate",
    }
)
CORRUPT_BYTES = 4096  # overwritten at the start of every spill file (spill-corrupt)


@dataclass
class Strike:
    """One fault during one phase. `react` is what the bench does once the failpoint
    fired: "" (the worker struck itself), "cont" (SIGCONT it after STOP_S), "kill-peer" /
    "stop-peer" (the decode worker the paused prefill is about to push to), "cancel" (the
    request that fired it), "corrupt" (the spill files of the worker about to reload),
    "moment" (no failpoint: strike when half the streams run), "kill-dest" / "stop-dest"
    (the decode worker a paused move goes to). `drain`: a fault that needs a live migration
    drains the busiest decode worker when half the streams run (undone at finish)."""

    fault: str
    cluster: object
    directory: str
    spill_root: str | None
    point: str | None = None
    react: str = ""
    concurrency: int = 1
    struck: bool = False
    note: str = ""
    drain: str = ""  # "" (no drain), "due", or the id of the decode worker being drained
    _drain_at: int = 0  # streams started (load.started) before the next drain
    _drainer: threading.Thread | None = None
    # pid -> process name of every process seen since arming: a worker that killed itself
    # at its failpoint is gone (and maybe restarted) by the time the marker is read
    _names: dict[int, str] = field(default_factory=dict)
    _undo: list[tuple[float, Callable[[], None]]] = field(default_factory=list)

    @classmethod
    def arm(
        cls, fault, cluster, directory, spill_root, concurrency: int, prefill_timeout_s: float
    ) -> Strike:
        s = cls(fault, cluster, directory, spill_root, concurrency=concurrency)
        action = ""
        if fault in ("none", "cancel"):  # cancel: the load walks away from half the streams
            s.struck = True
        elif (
            fault in ("router-restart", "black-hole")
            or fault.startswith("prefill-")
            and (fault.endswith("@stream"))
        ):
            s.react = "moment"
        elif fault in ("migrate-dest-kill", "migrate-dest-stop"):
            s.point, action = "decode.migrate", f"pause {PAUSE_S}"
            s.react = fault.removeprefix("migrate-dest-") + "-dest"
        elif fault.startswith("cancel@"):
            s.point, action, s.react = POINT[fault.split("@")[1]], f"pause {PAUSE_S}", "cancel"
        elif fault == "stalled-push":
            # past the router's prefill timeout: it gives up and resumes elsewhere
            s.point, action = "prefill.push", f"pause {prefill_timeout_s + 4:g}"
        elif fault == "spill-full":
            s.point, action = "disk.write", "error repeat"
        elif fault == "spill-corrupt":
            s.point, action, s.react = "kv.reload", f"pause {PAUSE_S}", "corrupt"
        else:  # ROLE-HOW@STATE
            head, state = fault.split("@")
            role, how = head.split("-")
            s.point = POINT[state]
            if s.point.startswith(role) or s.point.startswith("kv."):  # the worker itself
                action, s.react = ("kill", "") if how == "kill" else ("stop", "cont")
            else:  # a decode worker, struck while a prefill holds before pushing to it
                action, s.react = f"pause {PAUSE_S}", f"{how}-peer"
        if s.point == "decode.migrate":
            s.drain, s._drain_at = "due", max(1, concurrency // 2)
        if s.point is not None:
            s._seen()
            failpoints.arm(directory, "any", s.point, action)
        return s

    def _seen(self) -> None:
        self._names.update((p.pid, n) for n, p in zip(self.cluster.names, self.cluster.procs))

    def poll(self, load) -> None:
        now = time.monotonic()
        for due, undo in [u for u in self._undo if u[0] <= now]:
            self._undo.remove((due, undo))
            undo()
        if self.struck or self.react == "missed":
            return
        drainer = self._drainer
        if drainer is not None and not drainer.is_alive():  # over, and no move was struck
            self._drainer = None
            self._undrain()
            self.drain = "due"  # again once as many more streams run
            self._drain_at = load.started + max(1, self.concurrency // 2)
        if self.drain == "due" and load.started >= self._drain_at:
            self._start_drain()
        if self.react == "moment":
            if load.started >= max(1, self.concurrency // 2):
                self._at_moment(load)
                self.struck = True
            return
        self._seen()  # before the marker: a process started since the last poll may fire
        hit = failpoints.fired(self.directory, "any", self.point)
        if hit is None:
            return
        self.struck = True
        pid, detail = hit
        fired = f"{self.point} fired in {self._names.get(pid, f'pid {pid}')}"
        self.note = f"{self.note}; {fired}" if self.note else fired  # after "drained ..."
        if self.react == "cont":
            self._later(STOP_S, lambda: _signal(pid, signal.SIGCONT))
        elif self.react in ("kill-peer", "stop-peer"):
            self._strike_peer(detail)
        elif self.react in ("kill-dest", "stop-dest"):
            self._strike_dest(pid)
        elif self.react == "cancel":
            rid = detail.split()[0].split("~")[0]
            self.note += f"; cancelled {rid}" if load.cancel(rid) else f"; {rid} had ended"
        elif self.react == "corrupt":
            self._corrupt(pid)

    def finish(self) -> None:
        if self.point is not None:
            failpoints.disarm(self.directory, "any", self.point)
        for _, undo in self._undo:
            undo()
        self._undo.clear()
        if self._drainer is not None:
            self._drainer.join(timeout=60)
            self._drainer = None
        self._undrain()

    # -- a live migration ---------------------------------------------------------------
    def _undrain(self) -> None:
        """The drained worker gets requests again (unless it is gone)."""
        if self.drain not in ("", "due"):
            with contextlib.suppress(grpc.RpcError):
                drained(self.cluster.address, self.cluster.security, self.drain, undo=True)
            self.drain = ""

    def _start_drain(self) -> None:
        """Drain the busiest decode worker from a thread (its Drain call lasts until
        nothing is left on it, or fails when it dies)."""
        try:
            name, _ = busiest(self.cluster, "decode")
            wid = next(w for w, n in registered(self.cluster).items() if n == name)
        except (RuntimeError, StopIteration, grpc.RpcError) as e:
            self.note += f"; no decode worker to drain ({e})"
            self.drain = ""
            return
        self.drain = wid
        self.note += f"{'; ' if self.note else ''}drained {name}"

        def run() -> None:
            with contextlib.suppress(grpc.RpcError):
                drained(self.cluster.address, self.cluster.security, wid, timeout_s=120)

        self._drainer = threading.Thread(target=run, name="chaos-drain", daemon=True)
        self._drainer.start()

    # -- reactions ------------------------------------------------------------------------
    def _missed(self) -> None:
        """The state was reached but the strike could not be made: not struck (the run
        fails), and not tried again."""
        self.struck, self.react = False, "missed"

    def _later(self, seconds: float, undo: Callable[[], None]) -> None:
        self._undo.append((time.monotonic() + seconds, undo))

    def _strike_peer(self, detail: str) -> None:
        dest = detail.splitlines()[0].split()[1]
        try:
            name = registered(self.cluster).get(dest)
        except grpc.RpcError as e:
            self.note += f"; the router did not name {dest}'s process ({e.code().name})"
            self._missed()
            return
        if name is None:
            self.note += f"; its peer {dest} is not a live process"
            self._missed()
            return
        pid = self.cluster.procs[self.cluster.names.index(name)].pid
        self._kill_or_stop(name, pid, self.react == "kill-peer", "before the push to it")

    def _strike_dest(self, pid: int) -> None:
        """The decode worker that is not `pid` (the move's source): where the move goes."""
        others = [
            (n, p.pid)
            for n, p in zip(self.cluster.names, self.cluster.procs)
            if n.startswith("decode") and p.pid != pid and p.poll() is None
        ]
        if len(others) != 1:
            self.note += f"; no single destination to strike ({len(others)} other decode)"
            self._missed()
            return
        name, dest = others[0]
        self._kill_or_stop(name, dest, self.react == "kill-dest", "mid-move")

    def _kill_or_stop(self, name: str, pid: int, kill: bool, when: str) -> None:
        """SIGKILL `pid`, or SIGSTOP it for STOP_S (its SIGCONT scheduled); noted."""
        if kill:
            _signal(pid, signal.SIGKILL)
            self.note += f"; {name} SIGKILLed {when}"
        else:
            _signal(pid, signal.SIGSTOP)
            self._later(STOP_S, lambda: _signal(pid, signal.SIGCONT))
            self.note += f"; {name} SIGSTOPped for {STOP_S:g} s {when}"

    def _corrupt(self, pid: int) -> None:
        dirs = [d for d, owner in spill_dirs(self.spill_root or "").items() if owner == pid]
        files = [f for d in dirs for f in spill_files(d)]
        done = 0
        for path in files:
            with contextlib.suppress(FileNotFoundError), open(path, "r+b") as f:
                f.write(os.urandom(min(CORRUPT_BYTES, os.fstat(f.fileno()).st_size)))
                done += 1  # (one discarded meanwhile is skipped)
        self.note += f"; {done} spill files overwritten"

    def _at_moment(self, load) -> None:
        cluster = self.cluster
        if self.fault == "black-hole":
            close, answer = black_hole(cluster)
            self._later(STOP_S, close)
            self.note = f"its registration was answered {answer}"
        elif self.fault == "router-restart":
            _signal(cluster.procs[0].pid, signal.SIGKILL)
            self.note = "router-0 SIGKILLed"
        else:  # prefill-HOW@stream
            how = self.fault.split("@")[0].split("-")[1]
            name, pid = busiest(cluster, "prefill")
            if how == "kill":
                _signal(pid, signal.SIGKILL)
                self.note = f"{name} SIGKILLed"
            else:
                _signal(pid, signal.SIGSTOP)
                self._later(STOP_S, lambda: _signal(pid, signal.SIGCONT))
                self.note = f"{name} SIGSTOPped for {STOP_S:g} s"


def _signal(pid: int, sig: int) -> None:
    # it may have died meanwhile (a SIGCONT for a process the supervisor replaced)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def black_hole(cluster) -> tuple[Callable[[], None], str]:
    """A "decode worker" that accepts connections and never answers (a listening socket
    nobody reads), registered with the cluster's own credentials and an irresistible
    headroom -> (what closes it, the router's answer to its registration)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    info = pb.WorkerInfo(
        worker_id="black-hole",
        role="decode",
        address=f"127.0.0.1:{hole.getsockname()[1]}",
        total_blocks=1 << 20,
        free_blocks=1 << 20,
        headroom_blocks=1 << 20,
    )
    try:
        with auth.channel(cluster.address, cluster.security) as channel:
            rpc.RouterStub(channel).Register(
                pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=10
            )
        answer = "OK"
    except grpc.RpcError as e:
        answer = e.code().name
    return hole.close, answer
