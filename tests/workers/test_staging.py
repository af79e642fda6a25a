"""The step's host staging buffers are rewritten only after the copies that read them ran.

On CUDA a step's inputs go to the device by non-blocking copies from pinned memory that run
when the stream reaches them. A step that samples nothing (a middle chunk of a long prompt)
ends without a sync, so the next step could overwrite its ids, positions and slots before
they were copied. On CPU nothing is copied, so the tests stand a deferred copier in for the
stream: copies, and the model's "kernels", queue up and run only when a fence is waited on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.buffers import InputBuffers
from pdserve.workers.engine import LLMEngine
from pdserve.workers.tiny.builder import TinyModelSpec

CHUNK = 16


class DeferredCopier:
    """A fake CUDA stream: every copy and launch is queued and runs, in order, only up to a
    fence that is waited on (or at `drain`). `honour_fences=False` makes fences return at
    once, i.e. the engine as it was: nothing waits for a queued copy."""

    def __init__(self, honour_fences: bool = True) -> None:
        self.ops: list[Callable[[], None]] = []
        self.ran = 0
        self.honour_fences = honour_fences

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.append(lambda: dst.copy_(src))  # reads `src` when it runs, as a DMA does

    def launch(self, op: Callable[[], None]) -> None:
        self.ops.append(op)

    def fence(self) -> _Fence:
        return _Fence(self, len(self.ops))

    def run_until(self, n: int) -> None:
        while self.ran < n:
            self.ops[self.ran]()
            self.ran += 1

    def drain(self) -> None:
        self.run_until(len(self.ops))


@dataclass
class _Fence:
    stream: DeferredCopier
    at: int

    def synchronize(self) -> None:
        if self.stream.honour_fences:
            self.stream.run_until(self.at)


@dataclass
class Seen:
    """What one step's forward read from the device buffers when it ran."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]


def _engine_on_a_fake_stream(model_dir: Path, copier: DeferredCopier) -> tuple[LLMEngine, list[Seen]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=32,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=False, progress=False)
    eng = llm.engine
    runner = eng.runner
    runner.buf = InputBuffers(CHUNK, 4, -(-256 // runner.block_size), torch.device("cpu"), copier)
    hidden = eng.model_config.hidden_size
    seen: list[Seen] = []

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, kv: object) -> torch.Tensor:
        # A kernel on the stream: it reads the device buffers when the stream reaches it.
        copier.launch(lambda: seen.append(Seen(ids.tolist(), pos.tolist(), meta.slot_mapping.tolist())))
        return torch.zeros(ids.shape[0], hidden)

    runner.forward = forward
    return eng, seen


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec())


def _two_middle_chunks(eng: LLMEngine, copier: DeferredCopier) -> list[int]:
    """Prefill the first two chunks of a three-chunk prompt (neither samples: no read-back,
    no sync), then let the stream run everything queued. Returns the prompt."""
    prompt = list(range(100, 100 + 3 * CHUNK))
    eng.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for _ in range(2):
        assert eng.step() == []  # a middle chunk: nothing sampled
    copier.drain()
    return prompt


def test_a_step_waits_for_the_copies_of_the_last_before_rewriting_the_host_buffers(model_dir: Path) -> None:
    copier = DeferredCopier()
    eng, seen = _engine_on_a_fake_stream(model_dir, copier)
    prompt = _two_middle_chunks(eng, copier)
    blocks = eng.kv.blocks_of("long")
    bs = eng.runner.block_size
    for i, step in enumerate(seen):
        positions = list(range(i * CHUNK, (i + 1) * CHUNK))
        assert step.input_ids == prompt[i * CHUNK : (i + 1) * CHUNK]
        assert step.positions == positions
        assert step.slots == [blocks[p // bs] * bs + p % bs for p in positions]
    assert len(seen) == 2


def test_without_the_wait_the_first_chunk_reads_the_second_chunks_inputs(model_dir: Path) -> None:
    """The race the wait prevents, shown by the same fake stream with fences that do not wait
    (what the engine did before): chunk 1's forward ran over chunk 2's ids and positions, so
    chunk 1's KV was never written. It holds the test above to something it would catch."""
    copier = DeferredCopier(honour_fences=False)
    eng, seen = _engine_on_a_fake_stream(model_dir, copier)
    prompt = _two_middle_chunks(eng, copier)
    assert seen[0].input_ids == prompt[CHUNK : 2 * CHUNK]
    assert seen[0].positions == list(range(CHUNK, 2 * CHUNK))
