"""Decode steps replayed from CUDA graphs.

Why: an eager decode step launches 11-12 kernels per layer (about 400 for an 8B model), and
at small batch the host time of those launches is of the order of the GPU time. A graph
replays them all with one launch. Triton also compiles a kernel variant the first time a
batch shape needs it (seconds): capture at engine start compiles every variant a replayed
step uses, and `warm_eager_kernels` those of the steps that stay eager.

What is captured: the model's forward (embedding to final norm) for buckets of B sequences
with Q new tokens each, over the runner's persistent device inputs (InputBuffers: they never
move). B in [1, 2, 4, 8, 16, 32, 48, ...] up to max_num_seqs (at most 512); Q = 1 (decode)
and, with a speculator, Q = k + 1 (verification: the last known token and up to k drafts).
Logits and sampling stay eager, on the rows the step samples. Buckets are captured largest
first into one shared memory pool (as nano-vllm's `capture_cudagraph` does): the graphs never
run at once, so later ones reuse the first one's memory.

Padding: a step of n <= B sequences and t <= B*Q tokens replays bucket B. Pad sequence i
(n <= i < B) owns token t + i - n, with seq_len 0 (it attends to nothing); every pad token
has slot -1 (it writes no KV: the kernels skip such slots), token id 0 and position 0; in a
verify bucket the tokens after the last pad sequence's belong to no sequence. Attention
rows of pad tokens are zeros or never written; later ops are row-wise, so nothing of them
reaches a real row, and their hidden states are never read.

Host plans are fixed per bucket: a graph cannot re-plan from host values. Its
AttentionMetadata is built once, at capture, with host arrays that bound the step instead
of describing it: num_decode_seqs = B (Q = 1) or 0, query_start_loc_np = arange(B + 1) * Q,
seq_lens_np = the block tables' capacity, and `padded` set. So the Triton decode split count
and workspace come from B, the prefill grid and BLOCK_M from Q, and the torch reference's
gather width from the table width; the real lengths and offsets are read on the device. The
torch reference's multi-token path plans from host lengths, so verify buckets need the
Triton backend (CUDA) or, on CPU, the C++ decode op (pdserve/kernels/cpu_decode.py).

Selection (`select`): replay when every sequence has one new token and n fits the largest
decode bucket, or (verify buckets) when every sequence has at most Q new tokens and n fits
the largest verify bucket; else eager: steps with a longer prefill chunk, bigger batches.

`graph_factory` makes the graph objects (torch.cuda.CUDAGraph by default). Tests on CPU pass
a stand-in that "captures" by keeping the callable and "replays" by running it again over
the same static buffers (tests/workers/test_cuda_graphs.py).

Not run on a GPU yet: the capture, the replay and the memory they take are unmeasured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.buffers import InputBuffers

if TYPE_CHECKING:
    from pdserve.workers.memory_plan import ProfileSettings
    from pdserve.workers.model_runner import HostStep, ModelRunner

log = logging.getLogger(__name__)

MAX_BUCKET = 512  # sequences: larger decode batches run eagerly (their launches are a small share)


class Graph(Protocol):
    """A captured sequence of device work (torch.cuda.CUDAGraph behind `CudaGraph`)."""

    def capture(self, fn: Callable[[], None], pool: Any) -> None:
        """Record the device work `fn` issues; allocate from `pool` (None: a new pool)."""

    def replay(self) -> None:
        """Issue the recorded work again, over the same memory."""

    def pool(self) -> Any:
        """The memory pool the graph allocated from, to share with the next capture."""


class CudaGraph:
    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None], pool: Any) -> None:
        with torch.cuda.graph(self._graph, pool=pool):
            fn()

    def replay(self) -> None:
        self._graph.replay()

    def pool(self) -> Any:
        return self._graph.pool()


GraphFactory = Callable[[], Graph]


def decode_buckets(max_num_seqs: int, cap: int = MAX_BUCKET) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and the largest batch itself."""
    top = min(max_num_seqs, cap)
    return sorted({b for b in (1, 2, 4, 8) if b <= top} | set(range(16, top + 1, 16)) | {top})


@dataclass
class Bucket:
    seqs: int  # B
    rows: int  # Q: new tokens per sequence
    meta: AttentionMetadata  # views of the persistent device inputs, host plans fixed for this bucket
    graph: Graph | None = None
    hidden: torch.Tensor | None = None  # [B * Q, hidden]: what the captured forward writes
    replays: int = 0

    @property
    def tokens(self) -> int:
        return self.seqs * self.rows


class DecodeGraphs:
    """The captured buckets of one runner, and the replay of a step on one of them."""

    def __init__(self, runner: ModelRunner, buckets: list[int], verify_rows: int | None = None,
                 graph_factory: GraphFactory = CudaGraph) -> None:
        max_seqs = runner.buf.seq_lens.np.shape[0]
        max_tokens = runner.buf.input_ids.np.shape[0]
        self.runner = runner
        self.factory = graph_factory
        # A bucket of B sequences has B query rows: no more than the token buffers hold.
        self.decode = [self._bucket(b, 1) for b in sorted(buckets) if b <= min(max_seqs, max_tokens)]
        self.verify = [] if not verify_rows or verify_rows < 2 else [
            self._bucket(b, verify_rows) for b in sorted(buckets) if b <= max_seqs and b * verify_rows <= max_tokens]

    def _bucket(self, seqs: int, rows: int) -> Bucket:
        return Bucket(seqs, rows, _bucket_meta(self.runner, seqs, rows))

    # -- capture --------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, into one memory pool. Returns the seconds spent."""
        start = time.perf_counter()
        pool = None
        for bucket in sorted(self.verify + self.decode, key=lambda b: b.tokens, reverse=True):
            buf = self.runner.buf
            buf.begin_step()
            _stage(buf, bucket.seqs, bucket.tokens, 0, 0)  # all padding: writes no KV
            buf.end_step()
            run = self._forward_of(bucket)
            run()  # eagerly first: Triton compiles this bucket's variants, cuBLAS picks its kernels
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize()
            bucket.graph = self.factory()
            bucket.graph.capture(run, pool)
            pool = bucket.graph.pool()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _forward_of(self, bucket: Bucket) -> Callable[[], None]:
        b, runner = self.runner.buf, self.runner
        ids, positions = b.input_ids.device[: bucket.tokens], b.positions.device[: bucket.tokens]

        def run() -> None:
            bucket.meta.scratch.clear()  # per-step plans (masks, gathers) are made inside the graph
            bucket.hidden = runner.forward(ids, positions, bucket.meta, runner.kv_caches)

        return run

    # -- a step -----------------------------------------------------------------

    def bucket(self, seqs: int, rows: int) -> Bucket:
        """The captured bucket of `seqs` sequences of `rows` new tokens (the one rank 0 replays)."""
        for b in self.verify if rows > 1 else self.decode:
            if (b.seqs, b.rows) == (seqs, rows):
                return b
        raise RuntimeError(f"tensor parallel: rank 0 replays a CUDA graph of {seqs}x{rows} this rank did not capture")

    def select(self, step: HostStep) -> Bucket | None:
        """The bucket that replays this step, or None (run it eagerly)."""
        if step.num_seqs == 0:
            return None
        if step.max_rows == 1:
            found = _smallest(self.decode, step.num_seqs)
            if found is not None:
                return found
        if self.verify and step.max_rows <= self.verify[0].rows:
            return _smallest(self.verify, step.num_seqs)
        return None

    def replay(self, bucket: Bucket, step: HostStep) -> torch.Tensor:
        """Pad the step `_fill` wrote to `bucket`, copy it in, replay: hidden [num_tokens, hidden]."""
        assert bucket.graph is not None and step.num_seqs <= bucket.seqs and step.num_tokens <= bucket.tokens
        _stage(self.runner.buf, bucket.seqs, bucket.tokens, step.num_seqs, step.num_tokens)
        self.runner.feed_inputs(self.runner.buf.input_ids.device[: step.num_tokens])
        self.runner.buf.end_step()  # fence the copies before the replay (ModelRunner._forward says why)
        bucket.graph.replay()
        bucket.replays += 1
        assert bucket.hidden is not None
        return bucket.hidden[: step.num_tokens]

    def describe(self) -> str:
        def part(buckets: list[Bucket]) -> str:
            return ", ".join(f"{b.seqs}x{b.rows}: {b.replays}" for b in buckets)

        text = f"decode buckets (seqs x rows: replays) {part(self.decode)}"
        return text + (f"; verify {part(self.verify)}" if self.verify else "")


def _smallest(buckets: list[Bucket], num_seqs: int) -> Bucket | None:
    return next((b for b in buckets if b.seqs >= num_seqs), None)


def _bucket_meta(runner: ModelRunner, seqs: int, rows: int) -> AttentionMetadata:
    """Views of the persistent device inputs for `seqs` sequences of `rows` new tokens, with
    host plans that bound any step the bucket replays (see the module's docstring)."""
    b = runner.buf
    capacity = b.block_tables.np.shape[1] * runner.block_size
    return AttentionMetadata(
        slot_mapping=b.slot_mapping.device[: seqs * rows],
        block_tables=b.block_tables.device[:seqs],
        seq_lens=b.seq_lens.device[:seqs],
        query_start_loc=b.query_start_loc.device[: seqs + 1],
        num_decode_seqs=seqs if rows == 1 else 0,
        seq_lens_np=np.full(seqs, capacity, dtype=np.int32),
        query_start_loc_np=np.arange(seqs + 1, dtype=np.int32) * rows,
        block_size=runner.block_size,
        padded=True,
    )


def _stage(b: InputBuffers, seqs: int, tokens: int, n: int, t: int) -> None:
    """Pad the host buffers past a step's n sequences and t tokens up to `seqs` and `tokens`
    (see the module's docstring), then copy that whole extent to the device buffers."""
    b.input_ids.np[t:tokens] = 0
    b.positions.np[t:tokens] = 0
    b.slot_mapping.np[t:tokens] = -1
    b.seq_lens.np[n:seqs] = 0
    b.query_start_loc.np[0] = 0
    b.query_start_loc.np[n + 1 : seqs + 1] = t + np.arange(1, seqs - n + 1)
    for staged, count in ((b.input_ids, tokens), (b.positions, tokens), (b.slot_mapping, tokens),
                          (b.block_tables, seqs), (b.seq_lens, seqs), (b.query_start_loc, seqs + 1)):
        staged.to_device(count)


def wanted(config: ProfileSettings, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether an engine on `device` captures decode graphs (`capture` with CUDA's graphs)."""
    return not config.enforce_eager and device.type == "cuda" and backend is AttentionBackend.TRITON


def capture(config: ProfileSettings, runner: ModelRunner, backend: AttentionBackend,
            say: Callable[[str], None] = lambda _: None,
            graph_factory: GraphFactory | None = None, fallback: bool = True) -> DecodeGraphs | None:
    """Engine start: capture the runner's decode graphs and warm the kernels of eager steps;
    None when graphs are off (`enforce_eager`, no CUDA device, a backend that is not
    graph-safe there). `graph_factory`: stand-in graphs (tests, on CPU).

    Tensor-parallel ranks (workers/tp_follower.py) each capture the same buckets in the same order
    (every warm-up and capture run makes the model's collectives, NCCL's inside the graphs), and
    replay the bucket rank 0 names: a capture that fails fails the engine (`fallback` False), since
    one rank falling back to eager alone would leave the ranks' collectives apart."""
    if config.enforce_eager:
        return None
    if graph_factory is None:
        if runner.device.type != "cuda":
            return None
        if backend is not AttentionBackend.TRITON:
            say(f"CUDA graphs need the triton attention backend (not {backend.value}): decode runs eagerly")
            return None
        warm_eager_kernels(runner, config.max_num_seqs, config.max_num_batched_tokens)
    verify_rows = config.num_speculative_tokens + 1 if config.speculative is not None else None
    graphs = DecodeGraphs(runner, decode_buckets(config.max_num_seqs), verify_rows,
                          graph_factory or CudaGraph)
    cuda = runner.device.type == "cuda"
    before = torch.cuda.memory_reserved(runner.device) if cuda else 0
    try:
        seconds = graphs.capture()
    except Exception as e:  # noqa: BLE001 - a capture that fails leaves a working eager engine
        if not fallback:
            raise
        log.warning("CUDA graph capture failed, decode runs eagerly: %s: %s", type(e).__name__, e)
        say(f"CUDA graph capture failed ({type(e).__name__}: {e}); decode runs eagerly")
        if cuda:
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()
        return None
    # What the graphs hold comes out of the headroom the memory plan left (1 - gpu_memory_utilization
    # and its reserve for them): said, so a GPU run shows whether that was enough.
    held = (torch.cuda.memory_reserved(runner.device) - before) / 2**20 if cuda else 0.0
    say(f"captured {len(graphs.decode) + len(graphs.verify)} CUDA graphs in {seconds:.1f} s ({held:.0f} MiB)")
    return graphs


@torch.inference_mode()
def warm_eager_kernels(runner: ModelRunner, max_num_seqs: int, max_tokens: int) -> None:
    """Compile, before serving, the Triton variants that eager steps use: the decode kernel's
    per split count (it follows the number of decode rows in a mixed step) and the prefill
    kernel's per BLOCK_M (it follows the longest chunk), each with the chunk rows' metadata at
    an aligned and an unaligned offset (Triton specialises on 16-byte pointer alignment, and
    chunks start after the decode rows). Each runs once over padding: no KV is written."""
    from pdserve.kernels.configs import prefill_config
    from pdserve.kernels.triton_decode import choose_num_splits

    cfg = runner.model.config
    k_cache = runner.kv_caches[0][0]
    width = runner.buf.block_tables.np.shape[1]
    by_splits: dict[int, int] = {}
    for n in range(1, min(max_num_seqs, max_tokens) + 1):
        by_splits.setdefault(choose_num_splits(n, cfg.num_kv_heads, width, runner.block_size, k_cache.device), n)
    group_pad = 1 << max(0, (cfg.num_heads // cfg.num_kv_heads - 1).bit_length())
    by_block_m: dict[int, int] = {}
    q = 2
    while q + 1 <= max_tokens:
        by_block_m.setdefault(prefill_config(group_pad, cfg.head_dim, q, k_cache.dtype).block_m, q)
        q *= 2
    shapes = [(n, 0) for n in by_splits.values()]
    shapes += [(decode, q) for q in by_block_m.values() for decode in (0, 1) if decode < max_num_seqs]
    for num_decode, chunk in shapes:
        _run_padding(runner, num_decode, chunk)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def _run_padding(runner: ModelRunner, num_decode: int, chunk: int) -> None:
    """One eager step of `num_decode` one-token sequences and (chunk > 0) one sequence of
    `chunk` tokens, all padding (seq_len 0, slot -1)."""
    b = runner.buf
    seqs, tokens = num_decode + (chunk > 0), num_decode + chunk
    b.begin_step()
    b.input_ids.np[:tokens] = 0
    b.positions.np[:tokens] = 0
    b.slot_mapping.np[:tokens] = -1
    b.seq_lens.np[:seqs] = 0
    qsl = b.query_start_loc.np
    qsl[: num_decode + 1] = np.arange(num_decode + 1)
    qsl[seqs] = tokens
    meta = AttentionMetadata(
        slot_mapping=b.slot_mapping.to_device(tokens), block_tables=b.block_tables.to_device(seqs),
        seq_lens=b.seq_lens.to_device(seqs), query_start_loc=b.query_start_loc.to_device(seqs + 1),
        num_decode_seqs=num_decode, seq_lens_np=b.seq_lens.np[:seqs].copy(),
        query_start_loc_np=qsl[: seqs + 1].copy(), block_size=runner.block_size, padded=True)
    runner.forward(b.input_ids.to_device(tokens), b.positions.to_device(tokens), meta, runner.kv_caches)
    b.end_step()
