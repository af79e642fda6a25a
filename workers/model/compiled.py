"""The model's forward compiled with torch.compile (CPU), and the attention op it calls.

Why: a CPU decode step of a small model spends a third of its time outside
the matmuls, in some twenty small ops per layer (norms, RoPE, SiLU, views),
each paying PyTorch's per-op dispatch. Inductor fuses them into a few C++
loops: decode steps of SmolLM2-135M run 9-14% faster (docs/engine.md).

How: the whole layer stack is one graph. Attention is the one part it cannot
trace (it reads the paged cache through per-step block tables and plans with
host-side lengths), so it is a custom op that the graph calls as a black box,
and the step's metadata and caches reach that op through a per-thread step
context instead of as graph inputs. The caches are therefore invisible to the
compiler: no functionalization copies of a multi-GiB cache, and no recompiles
when the batch's shape of blocks changes. Only the token count varies between
graphs, and it is dynamic for every count, 1 included: dynamo would otherwise give
a one-token step (batch-1 decode) a graph of its own, whose kernels round
differently from the many-token graph's, so that in bfloat16 a speculative engine's
verify step (k + 1 rows) and a plain engine's decode step (1 row) took different
tokens on near ties. Traced "size-oblivious" (`backed_size_oblivious`: no 0/1
specialisation), one graph computes a row the same way whatever the row count: the
n-gram engine's greedy tokens equal the plain engine's in bfloat16 as in float32
(tests/workers/test_compiled.py), at the same batch-1 speed (docs/speculative.md).

Compilation happens at engine start (`warm_up`), not on a request's time: a
first start costs tens of seconds on a small CPU, later ones read Inductor's
on-disk cache. It needs a C++ compiler; without one, or on any compile error,
the engine logs why and runs eagerly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx.experimental._config as fx_config

from pdserve.kernels.attention import paged_attention
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.model import torch_ops

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Step:
    meta: AttentionMetadata
    kv_caches: KVCaches
    backend: AttentionBackend


_current = threading.local()  # .step: the _Step being run on this thread


def _step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    k_scale: float, v_scale: float) -> torch.Tensor:
    """paged_attention for layer `layer` of the step now running on this thread.

    It does write the step's K/V into the cache, but the cache is not an input
    the compiler sees, so declaring no mutation is truthful from the graph's
    view; calls stay ordered because each layer's q depends on the previous
    layer's output.
    """
    step: _Step | None = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError("pdserve::paged_attention called outside a model step")
    k_cache, v_cache = step.kv_caches[layer]
    return paged_attention(q, k, v, k_cache, v_cache, step.meta, scale, step.backend, (k_scale, v_scale))


def _step_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                         k_scale: float, v_scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# One kernel for every device: the attention backend the step names picks the device's code.
torch_ops.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, float k_scale, "
                 "float v_scale) -> Tensor", _step_attention, _step_attention_fake, "CompositeExplicitAutograd")


def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                   kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """The `pdserve::paged_attention` op: what the compiled model calls for attention."""
    out: torch.Tensor = torch.ops.pdserve.paged_attention(q, k, v, layer, scale, kv_scales[0], kv_scales[1])
    return out


# forward(input_ids, positions, meta, kv_caches) -> hidden: what the runner calls.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, KVCaches], torch.Tensor]


class CompiledForward:
    """Callable like the model: forward(input_ids, positions, meta, kv_caches).

    The model must accept meta=None and kv_caches=None, meaning "attention
    through `step_attention`" (LlamaForCausalLM does).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend
        # Many engines in one process (a draft model, tests) each add graphs to
        # the same code object; dynamo's default limit of 8 would silently
        # fall back to eager after a few.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._compiled = torch.compile(self._graph, dynamic=True)
        # Around every call, not only the warm-up's: a recompile happens inside a call.
        self._size_oblivious = fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]

    def _graph(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, None, None)
        return hidden

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: KVCaches) -> torch.Tensor:
        _current.step = _Step(meta, kv_caches, self.backend)
        try:
            with self._size_oblivious:
                out: torch.Tensor = self._compiled(input_ids, positions)
            return out
        finally:
            _current.step = None


def warm_up(forward: CompiledForward, kv_caches: KVCaches, block_size: int, max_tokens: int,
            device: torch.device) -> float:
    """Compile the graphs serving needs (one token, and many) before any request:
    two steps of one throwaway sequence in block 0, which no request holds yet (a
    later owner writes every slot before reading it). Returns the seconds spent."""
    start = time.perf_counter()
    n = max(2, min(block_size, max_tokens))  # many-token graph: any count >= 2 reaches it
    for count, first in ((n, 0), (1, n - 1)):
        positions = np.arange(first, first + count)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(positions, dtype=torch.int64, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([first + count], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=device),
            num_decode_seqs=1 if count == 1 else 0,
            seq_lens_np=np.array([first + count], dtype=np.int32),
            query_start_loc_np=np.array([0, count], dtype=np.int32),
            block_size=block_size,
        )
        # Made outside inference mode, like the runner's persistent input buffers:
        # dynamo guards on the difference, and a warm-up with inference tensors
        # would compile graphs that serving never uses.
        ids = torch.zeros(count, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        with torch.inference_mode():
            forward(ids, pos, meta, kv_caches)
    for k_cache, v_cache in kv_caches:  # leave block 0 as it was: zeros, like every fresh block
        k_cache[0].zero_()
        v_cache[0].zero_()
    return time.perf_counter() - start


def compile_forward(model: torch.nn.Module, backend: AttentionBackend, kv_caches: KVCaches, block_size: int,
                    max_tokens: int, device: torch.device, say: Callable[[str], None],
                    thread_counts: tuple[int, ...] = (), fallback: bool = True) -> Forward | None:
    """The compiled forward, warmed up at each of `thread_counts` (default: this
    thread's; dynamo specialises graphs on the thread count); None (and why, through
    `say`) when it cannot be used: the caller then runs the model eagerly (`fallback`
    False: a failure raises instead)."""
    if device.type != "cpu":
        return None  # CUDA has its own path (the Triton kernels); compiling it is untested there
    say("compiling the model (torch.compile; a first start takes a while, later ones use the cache) ...")
    try:
        forward = CompiledForward(model, backend)
        threads = torch.get_num_threads()
        seconds = 0.0
        try:
            for count in thread_counts or (threads,):
                torch.set_num_threads(count)
                seconds += warm_up(forward, kv_caches, block_size, max_tokens, device)
        finally:
            torch.set_num_threads(threads)
    except Exception as e:  # noqa: BLE001 - any compile failure leaves a working eager engine
        if not fallback:  # (tensor-parallel ranks: every rank compiled, or the engine fails)
            raise
        log.warning("torch.compile failed, running the model eagerly: %s: %s", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        say(f"torch.compile failed ({type(e).__name__}); running eagerly")
        return None
    say(f"compiled in {seconds:.1f} s")
    return forward
