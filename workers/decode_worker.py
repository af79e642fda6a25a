"""Decode role: reserve blocks for a prompt before its KV arrives, wait for the
transfer (with a deadline), join the continuous batch, stream token deltas.

Lifecycle of one request here: RESERVED (blocks held, WAITING_FOR_KV) ->
DECODING -> finished. A transfer that fails or misses its deadline never
reaches decoding with bad KV: by default the request is re-prefilled here from
its prompt (`recompute`), or fails with a clear error (`fail`); the reserved
blocks are freed either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import time
from collections.abc import AsyncIterator

from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.engine import LLMEngine
from pdserve.workers.messages import TransferState
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.transfer.base import FailReason, KVReceiver, TransferError
from pdserve.workers.transfer.recording import TransferRecorder


class KVFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class DecodeWorker:
    def __init__(self, engine: LLMEngine, receiver: KVReceiver,
                 on_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
                 transfer_recorder: TransferRecorder | None = None) -> None:
        """`transfer_recorder` hears of the transfers that fail here after the
        prefill worker saw them succeed (a failure it saw, it counted)."""
        self.engine = engine
        self.receiver = receiver
        self.on_failure = on_failure
        self.transfer_recorder = transfer_recorder
        self.async_engine = AsyncEngine(engine, worker_id=f"decode-{os.getpid()}")
        self.num_transfer_failures = 0

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], int] | None:
        """Allocate blocks for the prompt (reusing this worker's prefix cache) and
        register them with the receiver. Returns (block ids, tokens cached here)
        or None when the pool is full now. ValueError for bad input."""
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)

        def reserve(engine: LLMEngine) -> tuple[list[int], int] | None:
            plan = engine.reserve(request_id, prompt, params)
            if plan is not None:
                blocks, cached = plan
                skip = cached // engine.config.block_size
                if skip < len(blocks):
                    self.receiver.register(request_id, blocks[skip:], engine.model_config.num_layers)
            return plan

        return await self.async_engine.call(reserve)  # type: ignore[return-value]

    async def decode(self, request_id: str, prompt: list[int], first: RequestOutput | None, cached_here: int,
                     timeout_s: float = 600.0, first_sent: bool = False,
                     reply_to: str | None = None) -> AsyncIterator[RequestOutput]:
        """Wait for the KV, then stream DELTA outputs from the first token on.
        `first=None`: the prefill worker failed; apply the failure policy at once.
        `first_sent`: the caller already gave the client the first token (from the
        prefill worker's output): stream from the second token on.
        `reply_to`: the deltas go to that gateway token stream (see `AsyncEngine.stream`)."""
        deadline = time.monotonic() + timeout_s
        if first is None:
            self.receiver.abort(request_id)
            self.num_transfer_failures += 1
            ok = False
        elif cached_here < -(-len(prompt) // self.engine.config.block_size) * self.engine.config.block_size:
            ok = await self._wait_transfer(request_id, deadline)
        else:
            ok = True  # every block was already cached here: nothing was sent
        if ok:
            first_token = first.outputs[0].token_ids[0]  # type: ignore[union-attr]
            first_logprobs = (first.outputs[0].logprobs or [None])[0]  # type: ignore[union-attr]
            prompt_logprobs = first.prompt_logprobs  # type: ignore[union-attr]

            def start(e: LLMEngine) -> RequestOutput | None:
                out = e.complete_reservation(request_id, first_token, first_logprobs, prompt_logprobs)
                return _without_first_token(out) if first_sent and out is not None else out
        elif self.on_failure is KVFailurePolicy.RECOMPUTE and not first_sent:
            start = lambda e: e.prefill_locally(request_id)  # noqa: E731
        else:  # (a recomputed first token could differ from the one the client already has)
            await self.abort(request_id)
            raise TransferError(request_id, FailReason.TIMEOUT, "KV did not arrive intact; request failed")
        async for out in self.async_engine.stream(request_id, start, max(deadline - time.monotonic(), 0.0), reply_to):
            yield out

    async def abort(self, request_id: str) -> None:
        """Cancel wherever the request is: stop the transfer, free the blocks."""
        self.receiver.abort(request_id)
        await self.async_engine.call(lambda e: e.abort(request_id))

    async def _wait_transfer(self, request_id: str, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        try:
            status = await loop.run_in_executor(None, self.receiver.wait, request_id, deadline)
        finally:
            self.receiver.release(request_id)
        if status.state is TransferState.DONE:
            return True
        self.num_transfer_failures += 1
        if self.transfer_recorder is not None:
            self.transfer_recorder.on_failure((status.reason or FailReason.TIMEOUT).value)
        return False


def _without_first_token(out: RequestOutput) -> RequestOutput | None:
    """The engine's output for the first token, minus that token (the client has
    it already): nothing while the request runs on, an empty terminal delta if
    the request ends there."""
    if not out.finished:
        return None
    c = out.outputs[0]
    return dataclasses.replace(out, outputs=[dataclasses.replace(c, text="", token_ids=[],
                                                                 logprobs=[] if c.logprobs is not None else None)],
                               prompt_logprobs=None)
