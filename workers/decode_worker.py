"""Decode role: drive a request's handoff, then decode it in the continuous batch.

The gateway makes one call; this worker does the rest. A request's lifecycle
here (workers/lifecycle.py):

    ROUTED (reserving blocks for its prompt, reusing this worker's prefix cache)
      -> TRANSFERRING (blocks reserved; the prefill worker computes the prompt and
         streams its KV into them, then replies with the first token)
      -> DECODING (the KV is verified: the request joins the batch; its tokens go
         to the gateway's token stream) -> FINISHED
    ROUTED -> QUEUED (no room to reserve now: it queues and prefills here)
    TRANSFERRING -> QUEUED (the prefill worker or the transfer failed: by default
         the prompt is recomputed here, `recompute`; with `fail` the request fails;
         a prefill worker that is changing role is no failure: the prompt is
         recomputed here whatever the policy)
    any state -> ABORTED | FAILED: the transfer is stopped, the prefill worker
         told, the blocks freed.

A transfer that fails or misses its deadline never reaches decoding with bad KV.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import NamedTuple, Protocol

from pdserve.workers.async_engine import AsyncEngine, Job, RequestTimeoutError, Start, WorkerDrainingError
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import (
    FirstToken,
    KVFailurePolicy,
    PrefillOrder,
    Reservation,
    ServeRequest,
    transfer_key,
)
from pdserve.workers.lifecycle import Exit, RequestState
from pdserve.workers.messages import TransferState
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.role_worker import RoleWorker
from pdserve.workers.sampling_params import RequestOutputKind
from pdserve.workers.transfer.base import FailReason, KVReceiver, TransferError
from pdserve.workers.transfer.recording import TransferRecorder


class PeerFailedError(RuntimeError):
    """A worker this request depended on failed (it died, or its call did)."""


class PrefillPeer(Protocol):
    """The prefill worker a handoff uses, as the decode worker sees it (cluster/actors.py
    wraps a Ray handle; tests wrap an in-process worker)."""

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        """Prefill into the reserved blocks; the first token once the KV is all verified.
        Raises on failure (PeerFailedError when the worker itself is gone)."""
        ...

    def abort(self, request_id: str, attempt: int) -> None:
        """Stop the request's try `attempt` there; does not wait. Any thread."""
        ...


_PEER_GRACE_S = 0.25
# The prefill worker replies only once this receiver reported the KV verified, so
# the wait for that verdict here is short; this bounds it all the same.
_VERDICT_WAIT_S = 5.0


class DecodeWorker(RoleWorker):
    def __init__(self, engine: LLMEngine, receiver: KVReceiver,
                 on_failure: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
                 transfer_recorder: TransferRecorder | None = None, worker_id: str = "decode",
                 prefill_timeout_s: float | None = None, async_engine: AsyncEngine | None = None) -> None:
        """`transfer_recorder` hears of the transfers that fail here after the
        prefill worker saw them succeed (a failure it saw, it counted).
        `prefill_timeout_s`: the most a remote prefill and its transfer may take
        before the failure policy applies (None: until the request's deadline).
        `async_engine`: the engine's thread when the worker already has one (a
        worker that changes role keeps its engine and thread)."""
        super().__init__(engine, async_engine, worker_id)
        self.receiver = receiver
        self.on_failure = on_failure
        self.prefill_timeout_s = prefill_timeout_s
        self.transfer_recorder = transfer_recorder
        self.num_transfer_failures = 0
        # Reservations given up because their KV did not come within the remote
        # prefill's budget (`prefill_timeout_s`): the blocks' lease expired.
        self.num_leases_expired = 0
        # Its own threads for the receiver's blocking waits: the event loop's default
        # pool is shared with everything else in the process, and small.
        self._waits = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-wait")

    def close_role(self) -> None:
        """Close what the decode role holds (its wait threads), not the engine nor the
        receiver (the caller's): for a worker that takes another role."""
        self._waits.shutdown(wait=False, cancel_futures=True)

    async def serve(self, req: ServeRequest) -> None:
        """The whole request here (the router chose local prefill)."""
        await self.async_engine.serve(req)

    async def handoff(self, req: ServeRequest, peer: PrefillPeer) -> None:
        """Reserve blocks, have `peer` prefill into them, decode; every token to
        `req.reply_to`. Returns once the final delta is sent; raises the error that
        ended the request (ValueError for bad input), with every block freed."""
        params = req.params.with_output_kind(RequestOutputKind.DELTA)
        req = dataclasses.replace(req, params=params)
        await self.async_engine.grammar_ready(params)
        self.engine.validate(list(req.prompt_token_ids), params, grammar=False)
        ae = self.async_engine
        job = ae.open_stream(req, RequestState.ROUTED)
        try:
            start = await self._arrange(job, req, peer)
        except BaseException:
            ae.end(job, Exit.ABORTED)  # cancelled here; nothing if it ended already (deadline, failure)
            raise
        ae.begin(job, start)
        await ae.finished(job)

    # -- the handoff, step by step ---------------------------------------------------

    async def _arrange(self, job: Job, req: ServeRequest, peer: PrefillPeer) -> Start:
        """Everything before decoding: how to start the request on the engine."""
        ae = self.async_engine
        rid, prompt = req.request_id, list(req.prompt_token_ids)
        try:
            reservation = await ae.call(lambda e: self._reserve(e, job, req, peer), timeout_s=job.life.remaining())
        except TimeoutError:  # the engine thread did not get to it: do not wait on it again
            ae.end(job, Exit.DEADLINE)
            raise RequestTimeoutError(f"request {rid} passed its deadline here") from None
        if reservation is None:  # no room now: it queues and prefills here
            return lambda e, life: e.add_request(rid, prompt, req.params, life=life)
        if _over(job):
            # It ended while the blocks were reserved (an abort, the client gone): the prefill
            # worker is not asked for a prompt nobody wants (its abort may have come first).
            self._release(job)
            return lambda e, life: None
        try:
            first, peer_left = await self._remote_prefill(job, req, reservation, peer), False
        except WorkerDrainingError:  # the prefill worker is changing role: no KV fault, the prompt is ours
            first, peer_left = KVFailure(FailReason.ABORTED, "the prefill worker is changing role"), True
        failure = first if isinstance(first, KVFailure) else await self._kv_arrived(job, reservation, len(prompt))
        if failure is None:
            assert isinstance(first, FirstToken)
            job.tokens_sent = 1 if first.published else 0
            return lambda e, life: self._complete(e, job, first)
        # Nothing more may land in the reserved blocks before they are freed.
        self._release(job)
        if _over(job):
            # It ended meanwhile (the engine died, an abort): nothing starts, and `finished`
            # raises the error that ended it, not a KV failure of the policy's.
            return lambda e, life: None
        # The client may have the first token already (the prefill worker publishes it when
        # the prompt is done): the gateway drops the recomputed one if it matches, and moves
        # the request on from what the client has if not (cluster/token_collector.py).
        if self.on_failure is KVFailurePolicy.RECOMPUTE or peer_left:
            return lambda e, life: self._recompute(e, job)
        error = TransferError(rid, failure.reason, f"{failure.detail}; the request failed (--kv-failure-policy fail)")
        await ae.end_and_wait(job, Exit.PEER_FAILED, error)
        raise error

    def _reserve(self, e: LLMEngine, job: Job, req: ServeRequest, peer: PrefillPeer) -> Reservation | None:
        """Engine thread: blocks for the prompt (the request moves to TRANSFERRING),
        registered with the receiver; the exit hooks that undo each (last added,
        first run)."""
        rid, key = req.request_id, req.transfer_key
        if job.ending is not None or job.life.ended:
            return None  # its exit is on the way: reserve nothing
        plan = e.reserve(rid, list(req.prompt_token_ids), req.params, life=job.life)
        if plan is None:
            return None  # it stays ROUTED until it is added (and QUEUED) here
        blocks, cached = plan
        skip = cached // e.config.block_size
        if skip < len(blocks):
            self.receiver.register(key, blocks[skip:], e.model_config.num_layers)
            job.life.on_exit(lambda exit: self.receiver.release(key))  # a pending transfer: aborted

        def stop_peer(exit: Exit) -> None:
            if exit is not Exit.FINISHED:
                if not job.loop.is_closed():
                    job.loop.call_soon_threadsafe(peer.abort, rid, job.attempt)

        job.life.on_exit(stop_peer)
        return Reservation(tuple(blocks), cached)

    async def _remote_prefill(self, job: Job, req: ServeRequest, reservation: Reservation,
                              peer: PrefillPeer) -> FirstToken | KVFailure:
        """The prefill worker's reply, or why it (or its transfer) failed."""
        remaining = job.life.remaining()
        budget = remaining if self.prefill_timeout_s is None else min(remaining, self.prefill_timeout_s)
        order = PrefillOrder(dataclasses.replace(req, timeout_s=max(budget, 1e-3)), reservation, self.receiver.address)
        try:
            # The prefill worker keeps its own deadline and says why it missed it;
            # a moment more than its budget lets that answer arrive.
            async with asyncio.timeout(min(budget + _PEER_GRACE_S, remaining)):
                return await peer.prefill(order)
        except TimeoutError:
            if budget < remaining:
                self.num_leases_expired += 1
                self._count_failure(None)
                # The remote prefill's own budget ran out: the policy decides.
                return KVFailure(FailReason.TIMEOUT, f"the prefill worker did not answer within {budget:.1f} s")
            await self.async_engine.end_and_wait(job, Exit.DEADLINE)
            raise RequestTimeoutError(f"request {req.request_id} passed its deadline here") from None
        except WorkerDrainingError:
            raise  # not a failure: the caller recomputes whatever the policy
        except Exception as e:  # noqa: BLE001 - its transfer or the worker failed: the policy decides
            self._count_failure(None)
            if isinstance(e, TransferError):
                return KVFailure(e.reason, e.detail)
            return KVFailure(FailReason.PEER_LOST, f"the prefill worker failed: {type(e).__name__}")

    async def _kv_arrived(self, job: Job, reservation: Reservation, num_prompt_tokens: int) -> KVFailure | None:
        """None once every block the prefill worker sent is here and verified; else why not."""
        bs = self.engine.config.block_size
        if reservation.cached_tokens >= -(-num_prompt_tokens // bs) * bs:
            return None  # every block was cached here already: nothing was sent
        loop = asyncio.get_running_loop()
        try:
            deadline = min(job.life.deadline, time.monotonic() + _VERDICT_WAIT_S)
            status = await loop.run_in_executor(self._waits, self.receiver.wait, _key(job), deadline)
        except KeyError:
            # Its registration went with its exit: the job ended meanwhile (the engine died, an
            # abort, a later try of the request replaced it). Not a transfer failure: `_arrange`
            # starts nothing, and the job's own error (a dead engine's, which moves the request
            # elsewhere) is what its caller hears.
            return KVFailure(FailReason.ABORTED, "the request ended while its KV was on the way")
        finally:
            self._release(job)
        if status.state is TransferState.DONE:
            return None
        reason = status.reason or FailReason.TIMEOUT
        self._count_failure(reason)
        return KVFailure(reason, status.detail or "the KV did not arrive in time")

    def _release(self, job: Job) -> None:
        """Release `job`'s registration (a pending transfer: aborted). Each try registers
        under its own key (`transfer_key`), so this never touches a later try's."""
        self.receiver.release(_key(job))

    def _count_failure(self, reason: FailReason | None) -> None:
        self.num_transfer_failures += 1
        if reason is not None and self.transfer_recorder is not None:
            self.transfer_recorder.on_failure(reason.value)

    # -- engine thread: how decoding starts ------------------------------------------

    @staticmethod
    def _complete(e: LLMEngine, job: Job, first: FirstToken) -> RequestOutput | None:
        """The KV landed: decode from the prefill worker's first token. If that
        worker already published it, the client has it: only what follows goes out."""
        prompt_logprobs = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        out = e.complete_reservation(job.request_id, first.token_id, first.logprobs, prompt_logprobs,
                                     first.queue_time_s)
        if first.published and out is not None:
            return _without_first_token(out)
        return out

    @staticmethod
    def _recompute(e: LLMEngine, job: Job) -> None:
        """The KV did not come: prefill the prompt here (the reserved blocks are freed first)."""
        e.prefill_locally(job.request_id)


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


class KVFailure(NamedTuple):
    """Why a handoff's KV did not land: what `--kv-failure-policy fail` tells the client."""

    reason: FailReason
    detail: str


def _over(job: Job) -> bool:
    """Whether the job ended, or its end is on the way (an await may have seen it happen)."""
    return job.life.ended or job.ending is not None


def _key(job: Job) -> str:
    return transfer_key(job.request_id, job.attempt)
