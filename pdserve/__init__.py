"""pdserve: LLM serving with prefill and decode on separate worker pools.

The public offline API, the one vLLM users know:

    from pdserve import LLM, SamplingParams
    outs = LLM().generate(["Hello"], SamplingParams(max_tokens=32))

The names below are imported when first used (PEP 562), not with the package: a process
that needs only a light module (`pdserve.cluster.haproxy_guard`, run inside Ray Serve's
HAProxy manager) must not import torch and transformers on its way there. Measured: that
import held the manager's event loop for seconds under load, while its HAProxy was down.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.workers.llm import LLM
    from pdserve.workers.outputs import CompletionOutput, RequestOutput
    from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams

_WHERE = {
    "LLM": "pdserve.workers.llm",
    "SamplingParams": "pdserve.workers.sampling_params",
    "RequestOutputKind": "pdserve.workers.sampling_params",
    "RequestOutput": "pdserve.workers.outputs",
    "CompletionOutput": "pdserve.workers.outputs",
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
