"""pdserve: disaggregated prefill/decode LLM serving that stays out of the capacity trap."""

from pdserve.llm import LLM
from pdserve.outputs import RequestMetrics, RequestOutput
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
