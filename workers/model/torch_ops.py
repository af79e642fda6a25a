"""pdserve's ops (`torch.ops.pdserve.*`) as torch sees them: defined with torch.library's
low-level API.

Why not `torch.library.custom_op`: it wraps every call in Python layers (an aliasing
check of the outputs, a dynamo-disable context) that cost 3-7 us a call more than a
plain kernel registration (bench/experiments/custom_op_cost.py), and a compiled decode step calls
these ops four to five times a layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_lib = torch.library.Library("pdserve", "FRAGMENT")  # type: ignore[no-untyped-call]  # lives with the module


def define(schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor],
           dispatch_key: str) -> None:
    """Define `pdserve::<schema>` with `impl` as its kernel under `dispatch_key` ("CPU", or
    "CompositeExplicitAutograd" for every device) and `fake` for the compiler's tracing."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)  # type: ignore[no-untyped-call]
    _lib.impl(name, impl, dispatch_key)  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"pdserve::{name}", fake, lib=_lib)


__all__ = ["define"]
