"""`pdserve drain WORKER_ID --router HOST:PORT`: move every request off a decode worker
(live KV migration to the other decode workers) and give it no new ones, for an upgrade or
a scale-down; with --stop the router then tells the worker to stop (Decode.Shutdown: it
exits 0 as on SIGTERM). Worker ids as `ListWorkers` reports them. A cluster member's call:
it presents the cluster secret."""

from __future__ import annotations

import argparse
import sys


def cmd_drain(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.cli.serve import security_of
    from pdserve.progress import progress
    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.serving.drain import drain

    if args.undo and args.stop:
        print("pdserve drain: --undo and --stop: choose one", file=sys.stderr)
        return 2
    security = security_of(args, "drain")
    last = pb.DrainProgress()
    with progress(total=0, desc=f"draining {args.worker_id}", unit="req") as bar:
        try:
            messages = drain(
                args.router, security, args.worker_id, args.undo, args.timeout, args.stop
            )
            for msg in messages:
                bar.total = msg.moved + msg.remaining
                bar.update(msg.moved - last.moved)
                bar.set_postfix(failed=msg.failed, remaining=msg.remaining, refresh=False)
                last = msg
        except grpc.RpcError as e:
            print(f"pdserve drain: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.undo:
        print(f"{args.worker_id} gets new requests again")
        return 0
    if not last.done:
        print(
            f"pdserve drain: {last.remaining} requests still on {args.worker_id} "
            f"({last.moved} moved, {last.failed} moves failed)",
            file=sys.stderr,
        )
        return 1
    print(f"{args.worker_id} drained: {last.moved} moved ({last.failed} moves retried)")
    if args.stop and not last.stopped:
        print(f"pdserve drain: {args.worker_id} was drained but not stopped", file=sys.stderr)
        return 1
    if args.stop:
        print(f"{args.worker_id} told to stop")
    return 0


def add_drain_parser(sub) -> None:
    from pdserve.cli.serve import add_security_flags

    p = sub.add_parser(
        "drain", help="move every request off a decode worker, then leave it idle (or stop it)"
    )
    p.add_argument("worker_id", help="the decode worker, as ListWorkers reports it")
    p.add_argument("--router", required=True, help="the router's HOST:PORT")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many s")
    p.add_argument("--undo", action="store_true", help="give the worker new requests again")
    p.add_argument(
        "--stop",
        action="store_true",
        help="once nothing is left on it, stop the worker (its process exits 0; under "
        "`pdserve launch` the supervisor starts it again: an upgrade)",
    )
    add_security_flags(p, "member")
    p.set_defaults(func=cmd_drain)
