"""`pdserve launch`: a local cluster of separate processes (router, prefill and decode workers)
on 127.0.0.1, each on a port the OS picks. Waits until every worker is registered, prints the
router address, and stops everything on SIGINT/SIGTERM (or on `close()`), leaving no orphans.
While it runs, `Supervisor` restarts any process that exits (with backoff).

Every cluster gets a fresh cluster secret (pdserve/serving/auth.py), handed to each child on
its stdin (`--cluster-secret-file -`): never on a command line, never in an environment.
`Cluster.security` holds it for the launcher's own calls (and for tests and benchmarks that
act as cluster members). TLS files and API keys are passed on as paths.
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pdserve.lifetime import child_env
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import TLS, Security
from pdserve.serving.lease_dir import make_lease_dir

_CREDENTIAL_ENV = frozenset({auth.CLUSTER_SECRET_ENV, auth.API_KEY_ENV})


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths every member is started with (one certificate for all of them: its SANs
    must name 127.0.0.1)."""

    cert: str
    key: str
    ca: str

    def flags(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]


def _forward(stream) -> None:
    try:
        for line in stream:
            sys.stderr.write(line)
    except (OSError, ValueError):  # closed by close() while reading
        pass


def _read_ready(stream, lines: queue.Queue) -> None:
    """Hand the READY line (or "" at EOF) to `lines`; what comes before it (libraries may log
    to stdout first) and everything after it goes to our stderr: unread, a full pipe would
    block the child, and on our stdout it would mix into benchmark tables."""
    try:
        for line in stream:
            if line.startswith("READY "):
                lines.put(line)
                break
            sys.stderr.write(line)
        else:
            lines.put("")
            return
    except (OSError, ValueError):  # closed by close() while reading
        lines.put("")
        return
    _forward(stream)


def worker_threads(prefill: int, decode: int, prefill_tp: int = 1, decode_tp: int = 1) -> int:
    """Torch threads of each rank of a local cluster: workers sharing one machine's CPUs
    split them instead of oversubscribing (a worker of tensor-parallel size k gets k times
    this and splits it over its ranks; a role's --threads overrides it)."""
    ranks = prefill * prefill_tp + decode * decode_tp
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def computes_on_cpu(args: list[str]) -> bool:
    """Whether a worker started with `args` computes on the CPU: its --device read as the
    worker's argparse reads it (the last one wins, `--device=X` and abbreviations such as
    `--dev X` count), and "auto" (the default) as a worker resolves it (CUDA when torch has
    it). Arguments the worker would refuse count as "auto": it will not start anyway."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--device", default="auto")
    try:
        device = parser.parse_known_args(args)[0].device
    except (argparse.ArgumentError, SystemExit):  # e.g. --device without a value
        device = "auto"
    if device == "auto":
        import torch  # only here: the launcher itself computes nothing

        return not torch.cuda.is_available()
    return device == "cpu"


def router_idles(on_cpu: bool, decode_threads_per_rank: int, local_prefill: bool = False) -> bool:
    """Whether a local cluster's router runs at idle priority by default. A wake-up of the
    router preempts one thread of a decode rank's OpenMP team and the others wait for it at
    the next barrier; at idle priority it waits for a free CPU instead. That pays off only
    where a rank computes on several threads (1P1D on 2 CPUs, decode on both: 1.03-1.10x at
    32 clients); with one thread per decode worker the router's own delay is the larger
    cost (1P2D on 2 CPUs: 0.87-0.97x; docs/benchmarks.md). Not when decode workers compute
    prompts too (`local_prefill`, conditional disaggregation): their steps then follow one
    another with no gap, a router that waits for a free CPU hands prompts and tokens on late
    (1P1D on 2 CPUs at 32 clients: 0.96-0.97x of the router at normal priority, two
    interleaved rounds). SCHED_IDLE is Linux's."""
    if local_prefill:
        return False
    return on_cpu and decode_threads_per_rank > 1 and hasattr(os, "SCHED_IDLE")


class Cluster:
    def __init__(
        self,
        model: str,
        prefill: int = 1,
        decode: int = 1,
        port: int = 0,
        transfer: str = "nixl",
        worker_args: list[str] | None = None,
        router_args: list[str] | None = None,
        prefill_args: list[str] | None = None,
        decode_args: list[str] | None = None,
        startup_timeout_s: float = 180.0,
        http_port: int | None = None,
        tls: TLSFiles | None = None,
        api_key_file: str | None = None,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_threads: int | None = None,
        decode_threads: int | None = None,
        share_cpus: bool | None = None,
        router_idle: bool | None = None,
        local_prefill_tokens: int = 0,
    ) -> None:
        """`worker_args` go to every worker, `prefill_args`/`decode_args` to one role;
        `prefill_tp`/`decode_tp`: each worker of that role is a tensor-parallel group of
        that many ranks (one process each, started by the worker); `prefill_threads`/
        `decode_threads`: torch threads of each worker of that role (its ranks split them),
        instead of the even split of worker_threads(); `share_cpus`: every worker's threads
        span all the CPUs and the workers compute in turns (a CPU lease,
        pdserve/serving/cpu_lease.py; CPU workers only): None (the default) shares when
        the workers compute on the CPU, True insists (ValueError for GPU workers), False
        splits the CPUs evenly; `router_idle`: the router runs at idle priority, yielding
        the CPUs to the workers' compute (`serve router --sched-idle`,
        pdserve/serving/sched.py): None (the default) as router_idles() decides;
        `local_prefill_tokens`: the router's --local-prefill-tokens (conditional
        disaggregation: prompts of at most that many tokens computed by their decode worker;
        0, the default: none)."""
        for name, value in (
            ("prefill_threads", prefill_threads),
            ("decode_threads", decode_threads),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} (must be >= 1)")
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: {local_prefill_tokens} (must be >= 0)")
        secret = secrets.token_urlsafe(32)
        tls_pem = TLS.from_files(tls.cert, tls.key, tls.ca) if tls else None
        self.security = Security(cluster_secret=secret, tls=tls_pem)
        self._secret_line = f"{secret}\n"
        member = ["--cluster-secret-file", "-", *(tls.flags() if tls else [])]
        self.startup_timeout_s = startup_timeout_s  # for each READY line, then registration
        self.procs: list[subprocess.Popen] = []
        self.argvs: list[list[str]] = []  # how each was started, parallel to procs (restart)
        self.names: list[str] = []  # role-index of each process, parallel to procs
        self.metrics: dict[str, str] = {}  # role-index -> host:port of /metrics
        self.addresses: dict[str, str] = {}  # role-index -> host:port of its gRPC server
        self.http_address: str | None = None  # host:port of the OpenAI API, when asked for
        role_args = {
            "prefill": [*(worker_args or []), *(prefill_args or [])],
            "decode": [*(worker_args or []), *(decode_args or [])],
        }
        if share_cpus is not False or router_idle is None:
            on_cpu = all(computes_on_cpu(a) for a in role_args.values())
            if share_cpus and not on_cpu:
                raise ValueError("share_cpus: only workers that compute on the CPU take turns")
            share_cpus = on_cpu if share_cpus is None else share_cpus
        per_rank = worker_threads(prefill, decode, prefill_tp, decode_tp)
        # in turns, a prefill worker's ranks split every CPU and the decode workers' steps
        # (which overlap) split them between them
        cpus = os.cpu_count() or 1
        in_turns = {"prefill": cpus, "decode": max(1, cpus // max(1, decode))}
        threads_of = {
            role: given or (in_turns[role] if share_cpus else per_rank * tp)
            for role, given, tp in (
                ("prefill", prefill_threads, prefill_tp),
                ("decode", decode_threads, decode_tp),
            )
        }
        if router_idle is None:
            router_idle = router_idles(
                on_cpu, threads_of["decode"] // decode_tp, local_prefill_tokens > 0
            )
        self.router_idle = bool(router_idle)  # started with --sched-idle
        self.lease_dir = None  # the CPU lease's files, removed by close()
        self._lease_owner = None  # held locked while the cluster lives (make_lease_dir)
        try:
            if share_cpus:
                self.lease_dir, self._lease_owner = make_lease_dir()
            router = ["serve", "router", "--model", model, "--port", str(port), *member]
            if http_port is not None:
                router += ["--http-port", str(http_port)]
            if api_key_file is not None:
                router += ["--api-key-file", api_key_file]
            if router_idle:
                router.append("--sched-idle")
            if local_prefill_tokens:
                router += ["--local-prefill-tokens", str(local_prefill_tokens)]
            self.address = self._spawn([*router, *(router_args or [])])
            # a restarted router must come back where the workers look for it
            self.argvs[0][self.argvs[0].index("--port") + 1] = self.address.rsplit(":", 1)[1]
            if self.http_address is not None:
                at = self.argvs[0].index("--http-port") + 1
                self.argvs[0][at] = self.http_address.rsplit(":", 1)[1]
            common = ["--model", model, "--router", self.address, "--transfer", transfer, *member]
            if self.lease_dir is not None:
                common += ["--cpu-lease", os.path.join(self.lease_dir, "cpu")]
            # every worker starts at once (each loads the model and opens its transfer agent:
            # seconds apiece), then each READY line is read in turn
            started = []
            for role, count, tp in (
                ("prefill", prefill, prefill_tp),
                ("decode", decode, decode_tp),
            ):
                for _ in range(count):
                    own = ["--threads", str(threads_of[role]), "--tp", str(tp)]
                    argv = ["serve", role, *common, *own, *role_args[role]]
                    started.append((self._start(argv), argv))
            for proc, argv in started:
                self._ready(proc, argv)
            self._await_registered(prefill, decode, startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def cpus(self) -> dict:
        """How this cluster uses the node's CPUs (for benchmark reports), while it runs:
        `router_idle` is whether the router's threads are at idle priority, as read from
        /proc (False where the platform refused it, or has no /proc)."""
        from pdserve.serving.sched import thread_policies

        idle = False
        if self.router_idle and self.procs:
            try:
                idle = set(thread_policies(self.procs[0].pid).values()) == {os.SCHED_IDLE}
            except (OSError, AttributeError):
                idle = False
        return {"share_cpus": self.lease_dir is not None, "router_idle": idle}

    def restart(self, index: int) -> None:
        """Starts process `index` again, as it was first started (the router on its port)."""
        old = self.procs[index]
        if old.poll() is None:
            raise RuntimeError(f"{self.names[index]} is still running")
        if old.stdout:
            old.stdout.close()
        self._spawn(self.argvs[index], index)

    def _spawn(self, argv: list[str], index: int | None = None) -> str:
        """Start a process and wait for its READY line -> its gRPC address."""
        return self._ready(self._start(argv, index), argv, index)

    def _start(self, argv: list[str], index: int | None = None) -> subprocess.Popen:
        """Start a process (in slot `index`, or a new one) and hand it the secret."""
        env = {k: v for k, v in os.environ.items() if k not in _CREDENTIAL_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *argv],
            # this cluster's secret comes on stdin (a user's exported one stays here); a
            # killed launcher takes its children along (pdserve/lifetime.py: no preexec_fn)
            env=child_env(env, os.getpid()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: close() reaches its children
        )
        if index is None:
            self.procs.append(proc)
            self.argvs.append(list(argv))
        else:
            self.procs[index] = proc
        try:  # the secret, on a pipe only this child reads
            proc.stdin.write(self._secret_line)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the READY wait says so
        return proc

    def _ready(self, proc: subprocess.Popen, argv: list[str], index: int | None = None) -> str:
        """Read a started process's READY line (its addresses) -> its gRPC address; its
        name is recorded in start order."""
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_ready, args=(proc.stdout, lines), daemon=True).start()
        try:
            line = lines.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            proc.kill()
            raise TimeoutError(
                f"`pdserve {' '.join(argv[:2])}` printed no READY line within "
                f"{self.startup_timeout_s:.0f}s (killed)"
            ) from None
        if not line.startswith("READY "):
            try:  # its stdout closed: it is exiting, or has
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"`pdserve {' '.join(argv[:2])}` failed to start (exit {code})")
        _, role, address, metrics, *http = line.split()
        if http:
            self.http_address = http[0]
        if index is None:
            self.names.append(f"{role}-{sum(n.startswith(role) for n in self.names)}")
        name = self.names[index if index is not None else -1]
        self.metrics[name], self.addresses[name] = metrics, address
        return address

    def _await_registered(self, prefill: int, decode: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with auth.channel(self.address, self.security) as channel:
            stub = rpc.RouterStub(channel)
            while time.monotonic() < deadline:
                workers = stub.ListWorkers(pb.Empty(), timeout=5).workers
                roles = [w.role for w in workers]
                if roles.count("prefill") >= prefill and roles.count("decode") >= decode:
                    return
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("a worker process exited during start-up")
                time.sleep(0.1)
        raise TimeoutError(f"workers did not register within {timeout_s}s")

    def threads(self) -> dict[str, int]:
        """role -> the torch threads its workers were started with (their --threads)."""
        return {
            name.split("-")[0]: int(argv[argv.index("--threads") + 1])
            for name, argv in zip(self.names, self.argvs)
            if "--threads" in argv
        }

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        self.procs.clear()
        self.names.clear()
        if self.lease_dir is not None:
            shutil.rmtree(self.lease_dir, ignore_errors=True)
        if self._lease_owner is not None:
            self._lease_owner.close()  # (lets go of its lock)
            self._lease_owner = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Supervisor:
    """Restarts the processes of a cluster that exit, with backoff: the first restart at
    once, then after 1, 2, 4 ... up to `max_backoff_s` seconds while it keeps failing; one
    that stayed up `healthy_s` starts over at once. `step()` looks once (call it often)."""

    def __init__(
        self,
        cluster: Cluster,
        max_backoff_s: float = 30.0,
        healthy_s: float = 60.0,
        clock=time.monotonic,
        log=print,
    ) -> None:
        self.cluster, self.max_backoff_s, self.healthy_s = cluster, max_backoff_s, healthy_s
        self.clock, self.log = clock, log
        now = clock()
        self.started = [now] * len(cluster.procs)  # when each was last started
        self.failures = [0] * len(cluster.procs)  # exits in a row, each soon after its start
        self.due: list[float | None] = [None] * len(cluster.procs)  # when to restart it
        self.restarts = 0

    def step(self) -> None:
        now = self.clock()
        for i, proc in enumerate(self.cluster.procs):
            code = proc.poll()
            if code is None:
                continue
            name = self.cluster.names[i]
            if self.due[i] is None:  # seen for the first time
                if now - self.started[i] >= self.healthy_s:
                    self.failures[i] = 0
                wait = 0.0 if self.failures[i] == 0 else 2.0 ** (self.failures[i] - 1)
                wait = min(self.max_backoff_s, wait)
                self.failures[i] += 1
                self.due[i] = now + wait
                self.log(f"{name} exited ({code}); restarting it in {wait:.0f} s")
            if now >= self.due[i]:
                self.due[i] = None
                self.started[i] = now
                try:
                    self.cluster.restart(i)
                except RuntimeError as e:  # it failed to start: the next step tries again
                    self.log(f"{name} did not restart: {e}")
                    continue
                self.restarts += 1
                self.log(f"{name} restarted")


def run_launch(args) -> int:
    stop = {"now": False}

    def handler(*_):
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    worker_args = []
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        if not (args.tls_cert and args.tls_key and args.tls_ca):
            raise ValueError("tls: launch needs --tls-cert, --tls-key and --tls-ca together")
        tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca)
    if args.num_kv_blocks:
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.memory_per_rank is not None:
        worker_args += ["--memory-per-rank", str(args.memory_per_rank)]
    if args.gpu_memory_utilization is not None:
        worker_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    print(
        f"starting router, {args.prefill} prefill and {args.decode} decode workers ...", flush=True
    )
    with Cluster(
        args.model,
        args.prefill,
        args.decode,
        args.port,
        args.transfer,
        worker_args,
        http_port=args.http_port,
        tls=tls,
        api_key_file=args.api_key_file,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_threads=args.prefill_threads,
        decode_threads=args.decode_threads,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
        local_prefill_tokens=args.local_prefill_tokens,
    ) as c:
        print(f"cluster ready: router at {c.address}  (Ctrl-C stops everything)", flush=True)
        if c.http_address:
            print(f"OpenAI API at http://{c.http_address}/v1", flush=True)
        supervisor = Supervisor(c, log=lambda line: print(line, flush=True))
        while not stop["now"]:  # a process that exits is restarted, not the end of it all
            supervisor.step()
            time.sleep(0.2)
    print("cluster stopped", flush=True)
    return 0
