"""pdserve: disaggregated prefill/decode LLM serving that stays out of the capacity trap.

`from pdserve import LLM, SamplingParams`. The names are imported on first use, so that
`import pdserve.registry` (or any small module) does not load the engine, torch and the
kernels.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_WHERE = (
    ("LLM", "pdserve.llm"),
    ("RequestMetrics", "pdserve.outputs"),
    ("RequestOutput", "pdserve.outputs"),
    ("SamplingParams", "pdserve.sampling_params"),
)

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.outputs import RequestMetrics, RequestOutput
    from pdserve.sampling_params import SamplingParams


def __getattr__(name: str):
    for exported, module in _WHERE:
        if name == exported:
            return getattr(import_module(module), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
