"""Hardware profiles as data: what a machine's memory, compute, links and spill tiers can do.

Two kinds, one JSON file each (`pdserve/sim/profiles/*.json` built in, or any path):

    roofline   a GPU described by sourced constants (memory, measured copy bandwidth,
               measured GEMM rate, links, tiers) and efficiency factors stated as
               assumptions; a step costs max(bytes / bandwidth, FLOPs / rate) + overheads
    fitted     a machine measured by `pdserve sim calibrate`: step time as a linear function
               of what a step computes, fitted to the real engine's steps on that machine,
               plus the tiers' and (for clusters) the handoff's measured costs

Every number has a `sources` entry saying where it comes from. Bad files are refused with
the field named, before anything runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def per_seq_term(name: str) -> bool:
    """Whether a fitted step cost's term (pdserve/sim/cost.py FEATURES) is a cost per
    sequence: one row of every GEMM (`seqs`), one sampled token, the steeper slope past
    each knee. The others are the intercept (reading the weights, once a step whatever its
    batch), the KV's read (`decode_context`: it grows with the batch too, but as memory
    read, like the weights) and the prefill terms (pdserve/sim/fit.py split_over)."""
    return name in ("seqs", "sampled") or name.startswith("seqs_past_")


@dataclass(frozen=True)
class TierCost:
    spill_bytes_s: float
    reload_bytes_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int, reload: bool) -> float:
        return self.latency_s + nbytes / (self.reload_bytes_s if reload else self.spill_bytes_s)


@dataclass(frozen=True)
class LinkCost:
    """The prefill -> decode KV link (NIXL/UCX between workers)."""

    bytes_s: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class HandoffCost:
    """What a disaggregated request pays between the processes, beyond compute and the KV
    bytes: the router's calls (Reserve, Prefill, Start and their answers) and the stream."""

    reserve_s: float = 0.0  # a Reserve call, router to decode worker and back
    prefill_rpc_s: float = 0.0  # the Prefill call's transit both ways (not its compute)
    start_s: float = 0.0  # Start: router to decode worker, until its first step may include it
    per_token_s: float = 0.0  # streaming one token decode -> router -> client


@dataclass(frozen=True)
class Profile:
    name: str
    kind: str  # "roofline" | "fitted"
    memory_bytes: float  # one device's memory (GPU HBM; on CPU the KV budget it was measured at)
    usable_fraction: float  # of memory_bytes, for weights + KV + activations
    activation_reserve_bytes: float  # kept free for activations and workspace
    tiers: dict[str, TierCost]
    link: LinkCost
    dtype: str = "bfloat16"  # the KV dtype the engine uses there (float32 on CPU)
    handoff: HandoffCost = field(default_factory=HandoffCost)
    # roofline
    memory_bytes_s: float = 0.0  # measured device copy bandwidth
    flops: float = 0.0  # measured bf16 GEMM rate
    fp8_flops: float = 0.0
    memory_efficiency: float = 1.0  # assumption: share of memory_bytes_s a step reaches
    compute_efficiency: float = 1.0  # assumption: share of flops a step reaches
    step_overhead_s: float = 0.0  # assumption: per step (scheduling, launches)
    per_seq_overhead_s: float = 0.0  # assumption: per sequence in a step
    interconnect_bytes_s: float = 0.0  # NVLink per direction, for TP all-reduces
    allreduce_latency_s: float = 0.0
    # fitted: seconds per feature of a step (pdserve/sim/cost.py FEATURES)
    engine: dict[str, float] = field(default_factory=dict)  # the in-process engine
    cluster: dict[str, float] = field(default_factory=dict)  # a decode worker of a cluster
    # a decode worker of a cluster with more decode workers on the node ("2": 1P2D), where
    # they split its CPUs (pdserve/launch.py): its steps cost more than 1P1D's (`cluster`)
    cluster_decodes: dict[str, dict[str, float]] = field(default_factory=dict)
    cluster_prefill: dict[str, float] = field(default_factory=dict)  # a prefill worker
    # a cluster's workers take turns at the same CPUs (`pdserve launch --share-cpus`, its
    # default on CPU): a prefill batch's forward pass holds them all, decode steps wait
    shares_cpus: bool = False
    fit: dict[str, dict] = field(default_factory=dict)  # how well each fitted model fits
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("roofline", "fitted"):
            raise ValueError(f"profile {self.name}: kind: {self.kind!r}; choose roofline, fitted")
        if not isinstance(self.shares_cpus, bool):
            raise ValueError(
                f"profile {self.name}: shares_cpus: true or false, got {self.shares_cpus!r}"
            )
        if self.shares_cpus and self.kind == "roofline":
            raise ValueError(
                f"profile {self.name}: shares_cpus: GPU workers do not take turns at CPUs "
                "(a fitted CPU profile's field: pdserve sim calibrate --cluster sets it)"
            )
        self._check_cluster_decodes()
        for name in ("memory_bytes", "usable_fraction"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile {self.name}: {name}: must be > 0")
        if self.kind == "roofline":
            for name in ("memory_bytes_s", "flops"):
                if not getattr(self, name) > 0:
                    raise ValueError(f"profile {self.name}: {name}: a roofline needs it > 0")
        elif not self.engine:
            raise ValueError(f"profile {self.name}: engine: a fitted profile needs coefficients")

    def _check_cluster_decodes(self) -> None:
        from pdserve.sim.cost import FittedCost  # it imports this module

        where = f"profile {self.name}: cluster_decodes"
        if not isinstance(self.cluster_decodes, dict):
            raise ValueError(f"{where}: an object of coefficients by number of decode workers")
        for count, coefficients in self.cluster_decodes.items():
            if not (count.isdigit() and str(int(count)) == count and int(count) >= 2):
                raise ValueError(
                    f"{where}: keys are numbers of decode workers (2 or more; 1 is `cluster`), "
                    f"got {count!r}"
                )
            if not (isinstance(coefficients, dict) and coefficients):
                raise ValueError(f"{where}: {count}: coefficients of a fitted step, got none")
            try:  # unknown features are refused now, not mid-run
                FittedCost(coefficients)
            except ValueError as e:
                raise ValueError(f"{where}: {count}: {e}") from None

    def _check_scale(self, *factors: float) -> None:
        for factor in factors:
            if not (factor > 0 and factor != float("inf")):
                raise ValueError(f"scale: a positive finite factor, got {factor}")
        if self.kind != "fitted":
            raise ValueError(f"profile {self.name}: only a fitted profile's steps scale")

    def engine_scaled(self, factor: float) -> Profile:
        """The same profile with the in-process engine's steps `factor` times as long (a
        fitted profile's coefficients scaled; every cluster cost as measured)."""
        self._check_scale(factor)
        engine = {k: v * factor for k, v in self.engine.items()}
        return replace(self, name=f"{self.name} engine x{factor:.3g}", engine=engine)

    def cluster_scaled(
        self, decodes: int, decode: float, prefill: float, decode_per_seq: float | None = None
    ) -> Profile:
        """The same profile with a 1P`decodes`D cluster's decode steps `decode` times as long
        (the coefficients `cluster_decode(decodes)` picks; their terms per sequence
        `decode_per_seq` times instead, where given: per_seq_term) and its prefill batches
        `prefill` times (`cluster_prefill`, or the engine's where it has none, as the
        simulator picks them); the engine, tiers, link and handoff as measured."""
        per_seq = decode if decode_per_seq is None else decode_per_seq
        self._check_scale(decode, prefill, per_seq)
        key = self._cluster_decode_key(decodes)
        steps = {
            k: v * (per_seq if per_seq_term(k) else decode)
            for k, v in self.cluster_decode(decodes).items()
        }
        more = dict(self.cluster_decodes)
        if key is None:
            cluster = steps
        else:
            cluster, more[key] = self.cluster, steps
        return replace(
            self,
            name=f"{self.name} 1P{decodes}D decode x{decode:.3g}"
            + ("" if decode_per_seq is None else f" per seq x{per_seq:.3g}")
            + f" prefill x{prefill:.3g}",
            cluster=cluster,
            cluster_decodes=more,
            cluster_prefill={
                k: v * prefill for k, v in (self.cluster_prefill or self.engine).items()
            },
        )

    def _cluster_decode_key(self, decodes: int) -> str | None:
        measured = [int(n) for n in self.cluster_decodes if int(n) <= decodes]
        return str(max(measured)) if measured else None

    def cluster_decode(self, decodes: int) -> dict[str, float]:
        """A decode worker's step coefficients in a cluster with `decodes` decode workers:
        those measured at that count, else at the largest count measured below it (1:
        `cluster`)."""
        key = self._cluster_decode_key(decodes)
        return self.cluster if key is None else self.cluster_decodes[key]

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_fraction - self.activation_reserve_bytes


_NESTED = MappingProxyType({"link": LinkCost, "handoff": HandoffCost})


def builtin_profiles() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def load_profile(name: str) -> Profile:
    """A built-in profile by name (h100, h200, ...) or a JSON file path."""
    path = Path(name).expanduser()
    if not path.suffix:
        path = PROFILE_DIR / f"{name}.json"
        if not path.is_file():
            raise ValueError(
                f"profile: unknown {name!r}; built in: {', '.join(builtin_profiles())}, "
                "or a JSON file (pdserve sim calibrate writes one)"
            )
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"profile: cannot read {str(path)!r} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile: {str(path)!r} is not valid JSON ({e})") from None
    return profile_from_dict(raw, str(path))


def profile_from_dict(raw: dict, where: str = "profile") -> Profile:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(raw) - known - {"_about"})
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}")
    args = {k: v for k, v in raw.items() if k in known}
    try:
        args["tiers"] = {k: TierCost(**v) for k, v in raw.get("tiers", {}).items()}
        for key, cls in _NESTED.items():
            if key in raw:
                args[key] = cls(**raw[key])
        return Profile(**args)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
