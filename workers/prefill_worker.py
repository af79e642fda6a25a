"""Prefill role: compute a prompt's KV (chunked, with this worker's prefix cache),
stream it to the decode worker's reserved blocks as chunks complete, sample the
first token, free the blocks.

Lifecycle of one request here: PREFILLING (engine) -> TRANSFERRING (blocks held,
KV in flight) -> done (blocks released). Every exit releases the blocks: success
after `sender.finish` returns, failure after `sender.abort`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.workers.async_engine import AsyncEngine, RequestTimeoutError
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput, merge_deltas
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.transfer.base import FailReason, KVSender, TransferError
from pdserve.workers.transfer.recording import RecordingSender, TransferRecorder


@dataclass
class _Job:
    request_id: str
    sender: KVSender
    dst_blocks: list[int]
    next_block: int  # first block not sent yet (blocks the decode worker caches are skipped)
    num_prompt_tokens: int
    deadline: float
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[None]
    sent_layers: int = 0
    failed: BaseException | None = field(default=None)


class PrefillWorker:
    def __init__(self, engine: LLMEngine, sender_for: Callable[[str], KVSender],
                 transfer_recorder: TransferRecorder | None = None) -> None:
        """`sender_for(address)` returns the (cached) sender to a decode worker's receiver.
        `transfer_recorder` hears of every handoff: its bytes and duration, and
        its failures (the transport's, through `RecordingSender`, and this
        worker's own deadline)."""
        self.transfer_recorder = transfer_recorder
        self._recording: dict[str, KVSender] = {}
        self._sender_for = sender_for
        self._jobs: dict[str, _Job] = {}  # touched on the engine thread only, after registration
        self.async_engine = AsyncEngine(engine, on_step=self._after_step)
        self.engine = engine

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, dst_blocks: list[int],
        cached_on_decode: int, receiver: str, timeout_s: float = 60.0,
    ) -> RequestOutput:
        """Prefill `prompt`, send its KV into `dst_blocks` (skipping the first
        `cached_on_decode` tokens, which the decode worker holds), return the
        output carrying the first sampled token. Raises TransferError or
        RequestTimeoutError on failure, with every block freed."""
        loop = asyncio.get_running_loop()
        bs = self.engine.config.block_size
        job = _Job(request_id, self.sender_for(receiver), dst_blocks, cached_on_decode // bs, len(prompt),
                   time.monotonic() + timeout_s, loop, loop.create_future())
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                                           output_kind=RequestOutputKind.FINAL_ONLY)

        def start(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, first_params, hold_kv=True)
            self._jobs[request_id] = job

        first: RequestOutput | None = None
        try:
            async for out in self.async_engine.stream(request_id, start, timeout_s):
                first = out
            remaining = job.deadline - time.monotonic()
            await asyncio.wait_for(job.done, timeout=max(remaining, 0.0))
        except (TimeoutError, asyncio.CancelledError, Exception) as e:
            if job.done.done() and not job.done.cancelled():
                e = job.done.exception() or e  # the transfer's own error says more
            await self._cancel(request_id, f"prefill ended early: {type(e).__name__}")
            # The prompt was done and its KV still in flight at the deadline, and
            # the transport raised nothing (it would have counted it): a transfer timeout.
            if (isinstance(e, asyncio.TimeoutError) and first is not None and job.failed is None
                    and self.transfer_recorder is not None):
                self.transfer_recorder.on_failure(FailReason.TIMEOUT.value)
            if isinstance(e, asyncio.TimeoutError):
                raise RequestTimeoutError(f"prefill of {request_id} passed its deadline") from None
            raise
        assert first is not None
        return first

    async def generate_alone(self, request_id: str, prompt: list[int], params: SamplingParams,
                             timeout_s: float = 60.0) -> RequestOutput:
        """The whole request on this worker, no handoff: for requests that end at
        their first token (max_tokens 1: classification, scoring a prompt), where
        reserving decode blocks and shipping the KV would buy nothing. Returns the
        final output; aborts (blocks freed) on timeout or cancellation."""
        if params.max_tokens != 1:
            raise ValueError(f"max_tokens: generate_alone runs requests of 1 token, got {params.max_tokens}")
        final: RequestOutput | None = None
        async for out in self.async_engine.generate(request_id, prompt, params, timeout_s):  # deltas
            final = out if final is None else merge_deltas(final, out)
        assert final is not None and final.finished
        return final

    def sender_for(self, address: str) -> KVSender:
        sender = self._sender_for(address)
        if self.transfer_recorder is None:
            return sender
        if address not in self._recording:
            self._recording[address] = RecordingSender(sender, self.engine.kv_caches, self.transfer_recorder)
        return self._recording[address]

    async def _cancel(self, request_id: str, reason: str) -> None:
        def cancel(engine: LLMEngine) -> None:
            job = self._jobs.pop(request_id, None)
            if job is not None:
                job.sender.abort(request_id, reason)
            engine.abort(request_id)  # frees live or held blocks

        await self.async_engine.call(cancel)

    # -- engine thread -----------------------------------------------------------

    def _after_step(self, engine: LLMEngine) -> None:
        for rid in list(self._jobs):
            job = self._jobs[rid]
            progress = engine.progress(rid)
            if progress is None:  # aborted elsewhere
                self._jobs.pop(rid)
                continue
            computed, finished = progress
            try:
                self._send_ready(engine, job, computed, finished)
            except TransferError as e:
                job.failed = e  # read by prefill() once _cancel has run after this
                self._jobs.pop(rid)
                engine.abort(rid)
                job.loop.call_soon_threadsafe(_fail, job.done, e)
                continue
            if finished:
                self._jobs.pop(rid)
                engine.release(rid)
                job.loop.call_soon_threadsafe(_succeed, job.done)

    def _send_ready(self, engine: LLMEngine, job: _Job, computed: int, finished: bool) -> None:
        """Send every block whose KV is complete: full blocks as chunks finish,
        the last partial block once the whole prompt is done."""
        bs = engine.config.block_size
        ready = -(-computed // bs) if finished else computed // bs
        if ready <= job.next_block:
            if finished:
                job.sender.finish(job.request_id, job.deadline)
            return
        src = engine.blocks_of(job.request_id)
        blocks = range(job.next_block, ready)
        for layer in range(engine.model_config.num_layers):
            job.sender.send(job.request_id, layer, [src[i] for i in blocks], [job.dst_blocks[i] for i in blocks],
                            job.deadline)
        job.next_block = ready
        if finished:
            job.sender.finish(job.request_id, job.deadline)


def _succeed(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
