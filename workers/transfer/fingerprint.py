"""A model's fingerprint: what a KV link's hello names, so that a decode worker never takes KV computed by
another model (another checkpoint, another fine-tune, another config of the same shapes).

KV of the wrong model has the right shapes more often than not (two fine-tunes of one base, a model and
its quantized copy): the cache geometry check cannot see it, and the decode worker would generate from
it as if it were its own. The fingerprint is cheap, computed once when the worker starts: SHA-256 over
the model directory's config.json (which fixes every tensor's shape), then, per tensor in name order,
its name and dtype and its first 16 elements (a different checkpoint differs there in practice; a
full hash of the weights would cost seconds per GB at every start). What it does not see: two
checkpoints that agree on every sampled element, or a tokenizer change (the gateway tokenizes).

A tensor-parallel engine's fingerprint is its rank 0's, and equals the whole model's: rank 0's shard
of every tensor starts where the tensor does (its first rows; a row-parallel weight's first row's
first columns: at least 16 in any real model), and its shape is not hashed. So a prefill worker of
two ranks and a decode worker of one agree (workers/kv/shared_cache.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from pdserve.workers.model import fp8
from pdserve.workers.model.packed_linear import packed_weights
from pdserve.workers.transfer.auth import fingerprint_digest

_SAMPLE_ELEMENTS = 16


def model_fingerprint(model_dir: str | None, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The fingerprint of the model in `model_dir` whose loaded tensors are `tensors` (name, tensor)."""
    parts: list[bytes] = [b"pdserve-model/1"]
    config = os.path.join(model_dir, "config.json") if model_dir else None
    if config is not None and os.path.isfile(config):
        with open(config, "rb") as f:
            parts.append(f.read())
    with torch.no_grad():
        for name, t in sorted(tensors, key=lambda item: item[0]):
            parts.append(f"{name}|{t.dtype}".encode())
            piece = t.detach().reshape(-1)[:_SAMPLE_ELEMENTS]
            parts.append(piece.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return fingerprint_digest(*parts)


def module_fingerprint(model_dir: str | None, module: torch.nn.Module) -> str:
    """`model_fingerprint` of a loaded module's parameters, buffers and packed weights (those
    fingerprint as the plain weights they were: packing is a layout, not another model). A
    layer quantized at load (`--quantization fp8`) fingerprints as the weight it was made from,
    under a name of its own (the same checkpoint unquantized is another model's KV): its e4m3
    bytes and scales differ between a tensor-parallel rank 0's shard and the whole model's."""
    sources = dict(fp8.quantized_sources(module))
    made = {f"{layer}.{p}" for layer in sources for p in ("weight", "weight_scale")}
    tensors = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers(), *packed_weights(module)]
               if n not in made]
    return model_fingerprint(model_dir, [*tensors, *((f"{layer}.weight@fp8", s) for layer, s in sources.items())])


__all__ = ["model_fingerprint", "module_fingerprint"]
