"""`pdserve serve router|prefill|decode`: one role per process (one per GPU node in
production), wired from its flags: the engine core, the transfer agent, the role's config,
its gRPC service, its metrics endpoint and its registration with the router.

Each prints `READY <role> <host:port> <metrics host:port> [<http host:port>]` on stdout once
it serves, and stops cleanly on SIGINT/SIGTERM (workers deregister by going silent; the
router drops them after missed heartbeats). A decode worker that streams requests when told
to stop first asks its router to drain it (live migration: its requests move to the other
decode workers instead of being computed again there), for `--exit-drain-timeout` seconds
at most, serving all the while. gRPC and the roles are imported inside the run
functions, so that commands that need neither (e.g. `bench kernels` on a GPU node with only
torch and triton) still start.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import TYPE_CHECKING

from pdserve.cli.common import add_memory_flags
from pdserve.failpoints import Failpoints
from pdserve.lifetime import StopSignal

if TYPE_CHECKING:
    from pdserve.engine.args import EngineArgs


def _ready(role: str, host: str, port: int, metrics_port: int, http_port: int | None = None):
    """`READY role grpc-address metrics-address [http-address]` (pdserve launch reads it)."""
    http = f" {host}:{http_port}" if http_port is not None else ""
    print(f"READY {role} {host}:{port} {host}:{metrics_port}{http}", flush=True)


def security_of(args: argparse.Namespace, role: str):
    """The role's credentials from its flags and environment (pdserve/serving/auth.py). A
    role without a cluster secret says so: anyone who reaches its port may then register
    workers, reserve blocks and push KV."""
    from pdserve.serving.auth import TLS, Security, load_api_keys, load_secret

    secret = load_secret(args.cluster_secret_file)
    keys = load_api_keys(args.api_key, args.api_key_file) if role == "router" else ()
    if secret is None:
        print(
            f"pdserve {role}: no cluster secret (--cluster-secret-file or "
            "$PDSERVE_CLUSTER_SECRET): internal RPCs are open to anyone who reaches this port",
            file=sys.stderr,
            flush=True,
        )
    tls = TLS.from_files(args.tls_cert, args.tls_key, args.tls_ca)
    return Security(cluster_secret=secret, api_keys=keys, tls=tls)


def _http_ssl(args: argparse.Namespace):
    """The OpenAI endpoint's TLS context (server certificate only: HTTP clients are
    authenticated by API key, not by certificate)."""
    if not args.tls_cert:
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def engine_args(args: argparse.Namespace) -> EngineArgs:
    from pdserve.engine.args import EngineArgs  # torch: workers only, not the router

    return EngineArgs(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        memory_per_rank=args.memory_per_rank,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption=getattr(args, "preemption", "recompute"),
        spill_host_blocks=getattr(args, "spill_host_blocks", None),
        spill_cxl_blocks=getattr(args, "spill_cxl_blocks", None),
        spill_disk_blocks=getattr(args, "spill_disk_blocks", None),
        spill_dir=getattr(args, "spill_dir", None),
        cxl_path=getattr(args, "cxl_path", None),
        prefix_offload=args.prefix_offload,
        failpoints=Failpoints(args.failpoints),
        tensor_parallel_size=args.tp,
        cuda_graphs=not getattr(args, "no_cuda_graphs", False),
    )


def run_router(args: argparse.Namespace) -> int:
    from pdserve.client import CHANNEL_OPTIONS
    from pdserve.openai.local_call import LocalRouter
    from pdserve.openai.server import RouterView, start_http
    from pdserve.router.config import RouterConfig
    from pdserve.router.service import RouterService
    from pdserve.rpc import pdserve_pb2_grpc as rpc
    from pdserve.serving import auth
    from pdserve.serving.auth import Security
    from pdserve.serving.metrics import serve_metrics
    from pdserve.serving.server import start_server
    from pdserve.weights import resolve

    if args.sched_idle:  # before the servers start: their threads inherit it
        from pdserve.serving.sched import yield_cpus

        refused = yield_cpus()
        if refused is not None:
            print(f"pdserve router: --sched-idle not applied ({refused})", file=sys.stderr)
    security = security_of(args, "router")
    source = resolve(args.model)
    config = RouterConfig(
        max_model_len=args.max_model_len or source.config.max_position,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout,
        **{
            field: value
            for field, value in (
                ("prefill_timeout_s", args.prefill_timeout),
                ("lease_s", args.lease),
                ("max_resumes", args.max_resumes),
                ("migrate_timeout_s", args.migrate_timeout),
                ("migrate_policy", args.migrate_policy),
                ("migrate_low_free", args.migrate_low_free),
                ("local_prefill_tokens", args.local_prefill_tokens),
                ("token_feed", args.token_feed),
            )
            if value is not None
        },
    )
    service = RouterService(config, source.config.vocab_size, source.tokenizer, security)
    server, port = start_server(
        lambda s: rpc.add_RouterServicer_to_server(service, s),
        args.host,
        args.port,
        held_calls=config.max_queue,  # Generate streams the router admits at once
        security=security,
    )
    metrics_port = serve_metrics(service.metrics.registry, args.host, args.metrics_port)
    http = None
    if args.http_port is not None:
        registry = service.registry
        view = RouterView(
            vocab_size=source.config.vocab_size,
            max_model_len=config.max_model_len,
            tokenizer=source.tokenizer,
            metrics=service.metrics.registry,
            workers=lambda: (len(registry.alive("prefill")), len(registry.alive("decode"))),
            api_keys=security.api_keys,
            public_paths=tuple(args.public_path or PUBLIC_PATHS),
            # the front door calls this router's gRPC port as an HTTP caller's proxy: TLS
            # (with this router's certificate as its client one), the caller's key, no secret
            channel_factory=lambda address: auth.aio_channel(
                address, Security(tls=security.tls), CHANNEL_OPTIONS
            ),
            local=LocalRouter(
                service.Generate,
                lambda metadata: security.refusal(auth.DOORS[auth.GENERATE], metadata),
                config.max_queue,
                service.metrics.http_in_process.inc,
            )
            if args.http_in_process
            else None,
        )
        http = start_http(
            view, port, args.host, args.http_port, args.model, ssl_context=_http_ssl(args)
        )
    stop = StopSignal()
    _ready("router", args.host, port, metrics_port, http.port if http else None)
    stop.wait()
    if http is not None:
        http.close()
        if view.local is not None:
            view.local.close()
    server.stop(grace=2).wait()
    service.close()
    return 0


def _run_worker(args: argparse.Namespace, role: str) -> int:
    import torch

    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.rpc import pdserve_pb2_grpc as rpc
    from pdserve.serving.metrics import rank_memory_metrics, serve_metrics
    from pdserve.serving.registration import Registration
    from pdserve.serving.server import start_server
    from transfer import make_agent

    security = security_of(args, role)
    worker_id = args.worker_id or f"{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    if args.threads:
        torch.set_num_threads(args.threads)
    # the agent's name is this start's own: a worker restarted under a fixed --worker-id is
    # a new peer to those that pushed to the old one (transfer/writes.py Peers)
    agent = make_agent(args.transfer, f"{worker_id}@{uuid.uuid4().hex[:8]}")
    if role == "decode":
        from decode.config import DecodeConfig
        from decode.service import DecodeService
        from decode.worker import DecodeWorker

        config = DecodeConfig(
            worker_id,
            admission=args.admission,
            admission_margin=args.admission_margin,
            failpoints=Failpoints(args.failpoints),
            cpu_lease=args.cpu_lease,
            max_requests=args.max_requests,
        )
        worker = DecodeWorker.build(args.model, engine_args(args), config, agent)
        service = DecodeService(worker)
        add = lambda s: rpc.add_DecodeServicer_to_server(service, s)  # noqa: E731
        # a thread for every held request's Start stream (a worker holds no more: it
        # refuses their Reserves), besides the server's own for short calls and feeds
        held_calls = worker.state.max_requests
    else:
        from prefill.config import PrefillConfig
        from prefill.service import PrefillService
        from prefill.worker import PrefillWorker

        config = PrefillConfig(
            worker_id,
            kv_push=args.kv_push,
            failpoints=Failpoints(args.failpoints),
            cpu_lease=args.cpu_lease,
            turn_s=args.turn_s,
        )
        worker = PrefillWorker.build(args.model, engine_args(args), config, agent)
        service = PrefillService(worker)
        add = lambda s: rpc.add_PrefillServicer_to_server(service, s)  # noqa: E731
        from pdserve.router.config import RouterConfig

        # a Prefill call holds a thread until its push is done: as many as a router admits
        # requests at once (--max-queue's default), so that its batcher sees every queued
        # prompt and a Health probe is never stuck behind them
        held_calls = RouterConfig.max_queue
    # a rank of the group gone: out of service at once (the router stops routing to a
    # worker that does not answer; the launcher restarts it; the other ranks die with us)
    worker.core.on_rank_failure(_exit_on_rank_failure)
    server, port = start_server(add, args.host, args.port, held_calls, security)
    rank_memory_metrics(worker.metrics.registry, worker.core.memory())
    metrics_port = serve_metrics(worker.metrics.registry, args.host, args.metrics_port)
    info = pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=f"{args.host}:{port}",
        metrics_address=f"{args.host}:{metrics_port}",
    )
    registration = Registration(args.router, info, worker.stats, security) if args.router else None
    stop = StopSignal()
    _ready(role, args.host, port, metrics_port)
    stop.wait()
    if role == "decode" and registration is not None:
        _drain_before_exit(args, security, worker, worker_id)
    if registration is not None:
        registration.close()
    if role == "decode":  # its routers' feed calls end now, not at the server's grace
        worker.feeds.close_all()
    server.stop(grace=2).wait()
    worker.close()
    return 0


def _drain_before_exit(args: argparse.Namespace, security, worker, worker_id: str) -> None:
    """Told to stop while it streams requests: move them off first (the router's Drain of
    this worker, which keeps serving meanwhile), or give up after --exit-drain-timeout (its
    streams then resume elsewhere by recompute, as when a worker dies)."""
    import grpc

    from pdserve.serving.drain import drained

    # a reservation is a request whose prompt is still being computed for this worker: the
    # router moves it once it streams
    held = len(worker.streams) + len(worker.reservations)
    if args.exit_drain_timeout <= 0 or not held:
        return
    print(f"pdserve decode: draining {held} requests first", file=sys.stderr)
    try:
        ok = drained(args.router, security, worker_id, timeout_s=args.exit_drain_timeout)
    except grpc.RpcError as e:
        print(f"pdserve decode: drain before exit: {e.code().name}", file=sys.stderr)
        return
    print(f"pdserve decode: drain before exit: {'done' if ok else 'incomplete'}", file=sys.stderr)


RANK_FAILED_EXIT = 70  # EX_SOFTWARE


def _exit_on_rank_failure(error: Exception) -> None:
    print(f"pdserve: {error}; this worker leaves service", file=sys.stderr, flush=True)
    os._exit(RANK_FAILED_EXIT)


def run_prefill(args: argparse.Namespace) -> int:
    return _run_worker(args, "prefill")


def run_decode(args: argparse.Namespace) -> int:
    return _run_worker(args, "decode")


PUBLIC_PATHS = ("/health", "/metrics")


def add_security_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="file holding the cluster secret ('-': read its first line from stdin); "
        "default: $PDSERVE_CLUSTER_SECRET. Never on a command line.",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate of this member (TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed every member: mutual TLS")
    if role == "router":
        p.add_argument(
            "--api-key",
            action="append",
            default=[],
            help="accept this API key on Generate and the OpenAI API (repeatable; "
            "also --api-key-file and $PDSERVE_API_KEY, which keep it off `ps`)",
        )
        p.add_argument("--api-key-file", default=None, help="one API key per line")
        p.add_argument(
            "--public-path",
            action="append",
            default=None,
            help="HTTP paths served without an API key (default: /health and /metrics)",
        )


def add_serve_parser(sub) -> None:
    from decode.config import QUEUE_REQUESTS
    from pdserve.config import DEFAULT_PREEMPTION, PREEMPTION
    from pdserve.engine.admission import ADMISSION, DEFAULT_ADMISSION
    from pdserve.router.config import RouterConfig
    from prefill.config import KV_PUSH, PrefillConfig
    from transfer import PROCESS_BACKENDS

    serve = sub.add_parser("serve", help="run one role (router, prefill or decode)")
    roles = serve.add_subparsers(dest="role", required=True)
    for role, func in (("router", run_router), ("prefill", run_prefill), ("decode", run_decode)):
        p = roles.add_parser(role)
        p.add_argument("--model", required=True)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0, help="0: a free port chosen by the OS")
        p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port")
        p.add_argument("--max-model-len", type=int, default=None)
        add_security_flags(p, role)
        if role == "router":
            p.add_argument(
                "--http-port",
                type=int,
                default=None,
                help="serve the OpenAI-compatible HTTP API on this port (0: a free one)",
            )
            p.add_argument(
                "--sched-idle",
                action="store_true",
                help="run at Linux's idle scheduling priority, yielding the CPUs to workers "
                "that compute on them on this node (pdserve launch does so for CPU workers; "
                "docs/benchmarks.md)",
            )
            p.add_argument("--max-queue", type=int, default=RouterConfig.max_queue)
            p.add_argument("--queue-timeout", type=float, default=30.0)
            p.add_argument(
                "--prefill-timeout",
                type=float,
                default=None,
                help="a prefill's deadline, seconds (default 180); a reservation ended before "
                "its push arrived keeps its blocks fenced this long at most",
            )
            p.add_argument(
                "--migrate-policy",
                choices=("off", "pressure"),
                default=None,
                help="move streaming requests off a decode worker about to preempt to one "
                "with room (pressure; default off: docs/migration.md)",
            )
            p.add_argument(
                "--migrate-timeout",
                type=float,
                default=None,
                help="a live migration's deadline, seconds (default 30; a destination's "
                "blocks stay fenced this long at most after a failed move: docs/migration.md)",
            )
            p.add_argument(
                "--migrate-low-free",
                type=float,
                default=None,
                help="the pressure policy moves requests off a decode worker with less than "
                "this fraction of its pool free (default 0.2)",
            )
            p.add_argument(
                "--local-prefill-tokens",
                type=int,
                default=None,
                metavar="N",
                help="conditional disaggregation: a prompt of at most N tokens is computed by "
                "the decode worker that reserved it, beside its running batch, not on a "
                "prefill worker (default 0: every prompt goes to a prefill worker; "
                "docs/architecture.md)",
            )
            p.add_argument(
                "--http-in-process",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="the OpenAI front door (--http-port) calls this router's Generate in its "
                "own process (default), not over a loopback gRPC call",
            )
            p.add_argument(
                "--token-feed",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="each decode worker's tokens for this router on one call, a message a "
                "step for all its streams (default on; off: a message a token on each "
                "request's stream)",
            )
            p.add_argument(
                "--lease",
                type=float,
                default=None,
                help="reservation lease, seconds (default 10; renewed while the prefill runs)",
            )
            p.add_argument(
                "--max-resumes",
                type=int,
                default=None,
                help="times a request is resumed elsewhere after a worker fault (default 3)",
            )
        else:
            p.add_argument("--router", default=None, help="router address to register with")
            p.add_argument("--worker-id", default=None)
            p.add_argument("--transfer", default="nixl", choices=PROCESS_BACKENDS)
            p.add_argument("--block-size", type=int, default=16)
            p.add_argument("--num-kv-blocks", type=int, default=None)
            p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes, per rank")
            add_memory_flags(p)
            p.add_argument("--dtype", default="auto")
            p.add_argument("--device", default="auto")
            p.add_argument("--max-num-batched-tokens", type=int, default=2048)
            p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
            p.add_argument(
                "--cpu-lease",
                default=None,
                metavar="PATH",
                help="compute only in turns of this CPU lease, shared by the node's workers "
                "(pdserve launch sets it for CPU workers; pdserve/serving/cpu_lease.py)",
            )
            p.add_argument(
                "--no-cuda-graphs",
                action="store_true",
                help="run every decode step eagerly (CUDA graphs are on by default on CUDA)",
            )
            p.add_argument(
                "--tp",
                type=int,
                default=1,
                help="tensor-parallel ranks: this process is rank 0 and starts the others "
                "(one GPU each from --device; on CPU they split --threads)",
            )
            p.add_argument(
                "--failpoints",
                default=None,
                metavar="DIR",
                help="fault injection for tests and bench chaos: failpoints armed by files "
                "in DIR (pdserve/failpoints.py, docs/faults.md); never in production",
            )
            p.add_argument(
                "--prefix-offload",
                action="store_true",
                help="full blocks evicted from the prefix cache go to the spill tiers with "
                "their hashes; later prompts with the same prefix reload them",
            )
            p.add_argument(
                "--spill-host-blocks", type=int, default=None, help="host tier size in blocks"
            )
            if role == "decode":
                p.add_argument("--admission", default=DEFAULT_ADMISSION, choices=ADMISSION.names)
                p.add_argument("--admission-margin", type=float, default=0.05)
                p.add_argument("--preemption", default=DEFAULT_PREEMPTION, choices=PREEMPTION.names)
                p.add_argument("--spill-cxl-blocks", type=int, default=None)
                p.add_argument("--spill-disk-blocks", type=int, default=None)
                p.add_argument("--spill-dir", default=None, help="parent of the spill directory")
                p.add_argument("--cxl-path", default=None, help="file/DAX device for the CXL tier")
                p.add_argument(
                    "--max-requests",
                    type=int,
                    default=None,
                    help="the most requests held at once (each streams on a server thread; "
                    f"Reserves past it are refused as without room; default: max_num_seqs + "
                    f"{QUEUE_REQUESTS})",
                )
                p.add_argument(
                    "--exit-drain-timeout",
                    type=float,
                    default=30.0,
                    help="on SIGTERM, move streaming requests to other decode workers for "
                    "this long at most before stopping (0: stop at once; they resume by "
                    "recompute)",
                )
            if role == "prefill":
                p.add_argument(
                    "--kv-push",
                    default="auto",
                    choices=KV_PUSH,
                    help="push each layer as it is computed, or all after the forward pass "
                    "(auto: layer-wise on CUDA)",
                )
                p.add_argument(
                    "--turn-s",
                    type=float,
                    default=PrefillConfig.turn_s,
                    help="with --cpu-lease: each turn at the shared CPUs lasts about this long "
                    "(batches sized by the learned rate, a longer prompt in parts, a turn "
                    "each): about the longest wait it puts between two tokens of a decoding "
                    "request (0: batches by --max-num-batched-tokens alone; prefill/turns.py)",
                )
        p.set_defaults(func=func)
