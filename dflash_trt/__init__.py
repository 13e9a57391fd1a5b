"""dflash-trt: hybrid GDN/attention LLMs + DFlash speculative decoding as compiled graphs.

The subpackages live in top-level folders of the repository (export/, plugins/, engines/, runtime/,
tools/) and are installed as dflash_trt.export etc. (pyproject package-dir; `pip install -e .`).
The front door: `LLM` + `SamplingParams` (dflash_trt/api/), `dflash-trt serve` (dflash_trt/serve/).
"""
__version__ = "0.1.0"

from dflash_trt.abi import PoolSizes
from dflash_trt.api.llm import LLM
from dflash_trt.api.outputs import CompletionOutput, RequestOutput
from dflash_trt.api.params import SamplingParams
from dflash_trt.runtime.load import load_runtime
from dflash_trt.runtime.runtime import Runtime

__all__ = ["load_runtime", "Runtime", "PoolSizes", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "__version__"]
