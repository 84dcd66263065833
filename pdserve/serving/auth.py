"""Who may call what: the cluster secret, API keys and TLS, on every gRPC server and channel.

Each RPC has one of three doors, kept by one server interceptor (`AuthInterceptor`):

    OPEN     Health                                  anyone (probes, load balancers)
    CLIENT   Router.Generate, .Abort, .ListWorkers   an API key, when the router has keys
    CLUSTER  Router.Register, Decode.Reserve/.Start/ the cluster secret
             .Release/.Renew, Prefill.Prefill

The cluster secret opens every door (an operator, or a member). A door that is shut answers
UNAUTHENTICATED when no credential or a wrong one was presented, PERMISSION_DENIED when a
valid API key knocked on a CLUSTER door; the refused call's body is never parsed. Every
comparison is constant-time (hmac.compare_digest), against every key, with no early exit.

Credentials travel as gRPC metadata: `x-pdserve-cluster-secret: SECRET` and
`authorization: Bearer KEY`. The NIXL/ucxx metadata that lets a peer write into a pool only
travels inside Reserve answers and Prefill requests, so only through CLUSTER doors (and
under TLS when it is on); the NIXL agents open no listener of their own.

A server with no cluster secret leaves its CLUSTER doors open (a single-process test, a
trusted network); `pdserve serve` warns when it starts that way, `pdserve launch` never does.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

SECRET_METADATA = "x-pdserve-cluster-secret"
AUTH_METADATA = "authorization"
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEY_ENV = "PDSERVE_API_KEY"

OPEN, CLIENT, CLUSTER = "open", "client", "cluster"
_SERVICE = "/pdserve.v1."
GENERATE = f"{_SERVICE}Router/Generate"
DOORS: Mapping[str, str] = MappingProxyType(
    {
        GENERATE: CLIENT,
        f"{_SERVICE}Router/Abort": CLIENT,
        f"{_SERVICE}Router/ListWorkers": CLIENT,
        f"{_SERVICE}Router/Health": OPEN,
        f"{_SERVICE}Router/Register": CLUSTER,
        f"{_SERVICE}Decode/Reserve": CLUSTER,
        f"{_SERVICE}Decode/Start": CLUSTER,
        f"{_SERVICE}Decode/Release": CLUSTER,
        f"{_SERVICE}Decode/Renew": CLUSTER,
        f"{_SERVICE}Decode/Health": OPEN,
        f"{_SERVICE}Prefill/Prefill": CLUSTER,
        f"{_SERVICE}Prefill/Health": OPEN,
    }
)
MEMBER = "cluster"  # the identity of a caller that presented the cluster secret


@dataclass(frozen=True)
class TLS:
    """PEM bytes. A server needs `cert` and `key`; `ca` given means mutual TLS: servers ask
    every client for a certificate signed by it, and channels verify servers against it.
    A cluster member uses one certificate as server and as client (its SANs must name every
    address it is reached at)."""

    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)  # a private key prints nowhere
    ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: a certificate needs its key and a key its certificate")

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None) -> TLS | None:
        """None when no file is named."""
        if not (cert or key or ca):
            return None
        return cls(*(_read(path, "tls") if path else None for path in (cert, key, ca)))

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise ValueError("tls: a server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=bool(self.ca)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


@dataclass(frozen=True)
class Security:
    """One process's credentials: what its servers demand and what its channels present."""

    cluster_secret: str | None = None
    api_keys: tuple[str, ...] = ()  # the router's keys for CLIENT doors; none: those are open
    tls: TLS | None = None
    api_key: str | None = None  # an SDK's own key, presented on its calls

    def __post_init__(self) -> None:
        if self.cluster_secret is not None and len(self.cluster_secret) < 16:
            raise ValueError("cluster secret: needs at least 16 characters")
        # gRPC metadata and HTTP headers carry printable ASCII only
        for what, values in (
            ("cluster secret", [self.cluster_secret]),
            ("api keys", [*self.api_keys, self.api_key]),
        ):
            for v in values:
                if v is not None and (not v or v != v.strip() or not _printable_ascii(v)):
                    raise ValueError(f"{what}: each must be non-empty printable ASCII")

    def __repr__(self) -> str:  # never a credential in a log line or a traceback
        return (
            f"Security(cluster_secret={'set' if self.cluster_secret else None}, "
            f"api_keys={len(self.api_keys)}, tls={self.tls is not None})"
        )

    # -- what a caller presented ----------------------------------------------------------
    def is_member(self, metadata: Mapping[str, str]) -> bool:
        presented = metadata.get(SECRET_METADATA)
        return self.cluster_secret is not None and _same(presented, self.cluster_secret)

    def key_fingerprint(self, metadata: Mapping[str, str]) -> str | None:
        """A short stable name of the valid API key presented (None: no valid key)."""
        presented = bearer(metadata.get(AUTH_METADATA))
        match = None
        for key in self.api_keys:  # every key compared: the time says nothing of which
            if _same(presented, key):
                match = key
        return None if match is None else hashlib.sha256(match.encode()).hexdigest()[:16]

    def refusal(self, door: str, metadata: Mapping[str, str]) -> tuple[grpc.StatusCode, str] | None:
        """Why a call through `door` is refused (None: it may pass)."""
        if door == OPEN or self.is_member(metadata):
            return None
        if door == CLIENT:
            if not self.api_keys or self.key_fingerprint(metadata) is not None:
                return None
            return grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required"
        if self.cluster_secret is None:
            return None
        if self.key_fingerprint(metadata) is not None:
            return grpc.StatusCode.PERMISSION_DENIED, "this RPC is for cluster members only"
        return grpc.StatusCode.UNAUTHENTICATED, "the cluster secret is missing or wrong"

    def caller(self, context: grpc.ServicerContext) -> str:
        """Who is calling, for request ownership: the cluster, an API key, or else the
        connection (its peer address)."""
        metadata = dict(context.invocation_metadata())
        if self.is_member(metadata):
            return MEMBER
        key = self.key_fingerprint(metadata)
        return f"key:{key}" if key is not None else f"peer:{context.peer()}"

    # -- what this process presents -------------------------------------------------------
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = []
        if self.cluster_secret is not None:
            pairs.append((SECRET_METADATA, self.cluster_secret))
        if self.api_key is not None:
            pairs.append((AUTH_METADATA, f"Bearer {self.api_key}"))
        return tuple(pairs)


def _printable_ascii(s: str) -> bool:
    return s.isascii() and s.isprintable()


def bearer(value: str | None) -> str | None:
    if value is None or not value.startswith("Bearer "):
        return None
    return value[len("Bearer ") :]


def _same(presented: str | None, expected: str) -> bool:
    """Constant-time, and over digests: compare_digest returns at once on different
    lengths, which would tell a prober a key's length."""
    if presented is None:
        return False
    digest = hashlib.sha256(presented.encode(errors="replace")).digest()
    return hmac.compare_digest(digest, hashlib.sha256(expected.encode()).digest())


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None


# ---------------------------------------------------------------- loading credentials


def load_secret(path: str | None, environ: dict | None = None) -> str | None:
    """The cluster secret from a file ('-': the first line of stdin, as `pdserve launch`
    hands it over) or else from $PDSERVE_CLUSTER_SECRET, which is then removed from the
    environment so that no child inherits it. None when neither is given."""
    environ = os.environ if environ is None else environ
    from_env = environ.pop(CLUSTER_SECRET_ENV, "").strip()  # gone either way
    if path == "-":
        secret = sys.stdin.readline().strip()
    elif path:
        secret = _read(path, "cluster secret").decode().strip()
    else:
        secret = from_env
    if (path or secret) and not secret:
        raise ValueError(f"cluster secret: {path or CLUSTER_SECRET_ENV} is empty")
    return secret or None


def load_api_keys(keys: list[str] | None, path: str | None, environ: dict | None = None):
    """API keys from flags, a file (one per line, # comments) and $PDSERVE_API_KEY."""
    environ = os.environ if environ is None else environ
    found = list(keys or ())
    if path:
        lines = [line.strip() for line in _read(path, "api keys").decode().splitlines()]
        found += [line for line in lines if line and not line.startswith("#")]
    from_env = environ.pop(API_KEY_ENV, "").strip()
    if from_env:
        found.append(from_env)
    return tuple(dict.fromkeys(found))


# ---------------------------------------------------------------- servers


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, security: Security) -> None:
        self.security = security

    def intercept_service(self, continuation, details):
        door = DOORS.get(details.method, CLUSTER)  # a method not listed is shut
        refused = self.security.refusal(door, dict(details.invocation_metadata or ()))
        handler = continuation(details)
        if refused is None or handler is None:
            return handler
        return _refusing(handler, *refused)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    def deny(request, context):
        context.abort(code, message)

    def skip(body: bytes) -> bytes:  # a refused call's body is never parsed (None: gRPC's
        return b""  # sign of a failed parse)

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(deny, request_deserializer=skip)


# ---------------------------------------------------------------- channels


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _Present(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds this process's credentials to every call on a channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = pairs

    def _details(self, d):
        metadata = (*(d.metadata or ()), *self.pairs)
        compression = getattr(d, "compression", None)
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def channel(address: str, security: Security | None, options=()) -> grpc.Channel:
    """A channel that speaks TLS when `security.tls` is set and presents its credentials."""
    security = security or Security()
    options = list(options)
    if security.tls is not None:
        base = grpc.secure_channel(address, security.tls.channel_credentials(), options)
    else:
        base = grpc.insecure_channel(address, options)
    pairs = security.call_metadata()
    return grpc.intercept_channel(base, _Present(pairs)) if pairs else base


def aio_channel(address: str, security: Security | None, options=()) -> grpc.aio.Channel:
    """The asyncio twin of channel(), without credentials: aio callers pass
    `security.call_metadata()` on each call (aio interceptors wrap streaming calls in
    objects some callers cannot read from)."""
    security = security or Security()
    if security.tls is not None:
        return grpc.aio.secure_channel(address, security.tls.channel_credentials(), list(options))
    return grpc.aio.insecure_channel(address, list(options))
