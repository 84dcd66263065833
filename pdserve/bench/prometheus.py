"""Reading a worker's /metrics from a benchmark: one parser (prometheus_client's) for all.

text = scrape("127.0.0.1:9100")
total(text, "pdserve_decode_spill_used_blocks")            # summed over every tier
total(text, "pdserve_decode_reservations", state="fenced")  # one label set
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(address: str, timeout_s: float = 10.0) -> str:
    """The /metrics text of the process at host:port (OSError when it does not answer)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
