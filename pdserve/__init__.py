"""pdserve: LLM serving with prefill and decode on separate worker pools.

The public offline API, the one vLLM users know:

    from pdserve import LLM, SamplingParams
    outs = LLM().generate(["Hello"], SamplingParams(max_tokens=32))
"""

from pdserve.workers.llm import LLM
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
__version__ = "0.1.0"
