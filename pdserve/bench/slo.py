"""SLO goodput, DistServe's definition: the rate of requests whose TTFT and mean TPOT both
meet their targets (and the tokens those requests generated).

    SLO(ttft_s=2.0, tpot_s=0.1)                 absolute targets, seconds
    parse_slo("ttft=2,tpot=0.1")                the same from a command line
    parse_slo("ttft=5x,tpot=2x")                relative: multiples of the unloaded TTFT and
                                                TPOT p50 (`resolve(unloaded_ttft, unloaded_tpot)`)
    goodput(requests, slo, seconds)             -> (requests/s, tokens/s)

A request is a mapping with `ttft_s`, `tpot_s`, `output_tokens` (the per-request records
`bench sweep` and `bench serve` write, so that any SLO can be applied afterwards); one that
failed has `error` set and never meets an SLO.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# the sweep's default: relative, so that it means the same on any machine. TTFT may grow to
# 5x the unloaded (queueing is allowed), a stream may run at half its unloaded speed.
DEFAULT_SWEEP_SLO = "ttft=5x,tpot=2x"


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    relative: bool = False  # the two values are multiples of the unloaded p50s

    def resolve(self, unloaded_ttft_s: float, unloaded_tpot_s: float) -> SLO:
        """Absolute targets (a relative SLO times the unloaded values; an absolute one as is)."""
        if not self.relative:
            return self
        return SLO(self.ttft_s * unloaded_ttft_s, self.tpot_s * unloaded_tpot_s)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        assert not self.relative, "resolve() a relative SLO first"
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s

    def label(self) -> str:
        unit = "x" if self.relative else " s"
        return f"TTFT <= {self.ttft_s:g}{unit}, TPOT <= {self.tpot_s:g}{unit}"

    def to_dict(self) -> dict:
        """JSON-ready: an unbounded target is null."""
        finite = lambda v: v if v != float("inf") else None  # noqa: E731
        return {
            "ttft_s": finite(self.ttft_s),
            "tpot_s": finite(self.tpot_s),
            "relative": self.relative,
        }


def parse_slo(text: str) -> SLO:
    """`ttft=SECONDS,tpot=SECONDS` or `ttft=Nx,tpot=Nx` (both absolute or both relative;
    either may be left out for its default) -> SLO. ValueError naming the part."""
    fields: dict[str, float] = {}
    kinds = set()
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"slo: expected ttft=SECONDS,tpot=SECONDS (or Nx), got {text!r}")
        relative = value.endswith("x")
        kinds.add(relative)
        try:
            number = float(value[:-1] if relative else value)
        except ValueError:
            raise ValueError(
                f"slo: {key}: expected seconds or a multiple (2x), got {value!r}"
            ) from None
        if not 0 < number < float("inf"):
            raise ValueError(f"slo: {key}: must be a positive finite number, got {value!r}")
        fields[f"{key}_s"] = number
    if len(kinds) > 1:
        raise ValueError(f"slo: ttft and tpot must both be seconds or both multiples: {text!r}")
    relative = kinds.pop()
    if relative:
        fields = {"ttft_s": 5.0, "tpot_s": 2.0} | fields
    return SLO(**fields, relative=relative)


def goodput(requests: Iterable[Mapping], slo: SLO, seconds: float) -> tuple[float, float]:
    """(requests/s, tokens/s) over `seconds` of the requests that met `slo` (absolute)."""
    good = [
        r
        for r in requests
        if not r.get("error") and r["output_tokens"] > 0 and slo.meets(r["ttft_s"], r["tpot_s"])
    ]
    if seconds <= 0:
        return 0.0, 0.0
    return len(good) / seconds, sum(r["output_tokens"] for r in good) / seconds
