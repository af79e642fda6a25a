"""One request's KV handoff on a prefill worker: the state object its job carries.

A `PrefillHandoff` is the job's role (`JobRole`, workers/async_engine.py): the
engine thread hands it the request's output and calls it after every step; the
link's thread reports each send; the job's exit hook stops it. Each method says
which thread calls it. Its progress, in the request's lifecycle:

    PREFILLING    after each step, the blocks a chunk completed are queued on the
                  link (their KV leaves from the link's thread once the step's
                  kernels are done: workers/transfer/streams.py)
    TRANSFERRING  the prompt is done (the scheduler moved it when the request
                  finished, holding its blocks): the first token goes to the
                  gateway when nothing can take it back, then the end marker is
                  queued; the decode worker's verdict comes back through the link
    end           verified: `first` is the reply to the decode worker, and the job
                  ends FINISHED (its held blocks go back to the prefix cache); a
                  failed send ends it PEER_FAILED; any other exit aborts the sender
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from pdserve.workers.async_engine import AsyncEngine, Job, done_notice
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import FirstToken, PrefillOrder
from pdserve.workers.lifecycle import Exit
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.token_stream import GATEWAY_GONE_S, TokenStreamPublisher
from pdserve.workers.transfer import streams
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import FailReason, KVSender, TransferError
from pdserve.workers.transfer.recording import TransferRecorder
from pdserve.workers.transfer.send_queue import SendQueue

GONE_CHECK_S = 5.0  # how often the first tokens' publisher looks for gateways gone for good


class FirstTokens:
    """The prefill worker's own token-stream publisher, for first tokens only (the
    engine thread's publisher carries whole requests). Any thread: locked."""

    def __init__(self, worker_id: str, secret: ClusterSecret | None) -> None:
        self._publisher = TokenStreamPublisher(f"{worker_id}-first", secret=secret)
        self._lock = threading.Lock()
        self._next_gone_check = 0.0

    def send(self, address: str, delta: RequestOutput, attempt: int) -> None:
        with self._lock:
            self._publisher.add(address, delta, 0, attempt)
            self._publisher.flush()
            now = time.monotonic()
            if now >= self._next_gone_check:
                # Every gateway that ever asked keeps a socket here: those gone for good (a
                # replica replaced, its stream's port new) are closed, not reconnected for ever.
                self._next_gone_check = now + GONE_CHECK_S
                self._publisher.gone(GATEWAY_GONE_S)

    def close(self) -> None:
        with self._lock:
            self._publisher.close()


class PrefillHandoff:
    """The KV of one request on its way to a decode worker's reserved blocks."""

    def __init__(self, job: Job, order: PrefillOrder, link: SendQueue, ae: AsyncEngine, first_tokens: FirstTokens,
                 recorder: TransferRecorder | None, device: torch.device, block_size: int) -> None:
        self.job, self.order, self.link = job, order, link
        self._ae, self._first_tokens, self._recorder, self._device = ae, first_tokens, recorder, device
        self.next_block = order.reservation.skip_blocks(block_size)  # blocks the decode worker caches are skipped
        self.output: RequestOutput | None = None  # the engine's final output: the first token
        self.first: FirstToken | None = None  # the reply, once the decode worker verified every block
        self.published = False  # the first token went to the gateway (when the prompt was done)
        self.failed: TransferError | None = None
        self.finishing = False  # the end marker is queued: the verdict comes back through the link
        # Engine thread: the blocks of each queued send, held (a reference each) until the send has
        # read them. A request preempted meanwhile frees its own references; these keep its blocks
        # from another request, whose KV the send would carry under a checksum of what it read.
        self._pins: dict[int, list[int]] = {}
        self._next_pin = 0
        self._engine: LLMEngine | None = None

    def over(self) -> bool:
        """Whether queued sends of this request should be skipped (any thread)."""
        return self.job.life.ended or self.job.ending is not None or self.failed is not None

    # -- engine thread ------------------------------------------------------------

    def take_output(self, out: RequestOutput) -> None:
        """The request's only output: its final one, carrying the first token."""
        self.output = out

    def after_step(self, engine: LLMEngine) -> None:
        """Queue the sends of the blocks that are ready; once the prompt is done, the
        first token to the gateway and the end marker to the decode worker."""
        progress = engine.prefill_progress(self.job.request_id)
        if progress is None or self.job.life.ended or self.finishing:
            return
        computed, done = progress
        bs = engine.config.block_size
        ready = -(-computed // bs) if done else computed // bs
        if ready > self.next_block:
            self._send_blocks(engine, range(self.next_block, ready))
            self.next_block = ready
        if done:
            assert self.output is not None, "the prompt is done but its first token never came"
            self.finishing = True
            # The client has its first token now, not after the KV's verdict: the time
            # the last layers and the verdict take is off its TTFT.
            self.published = self._publish_first(self.output)
            key = self.order.request.transfer_key
            self.link.submit(key, lambda sender, wait_until: sender.finish(key, wait_until), self.job.life.deadline,
                             lambda error: self.sent(error, last=True), self.over)

    def unpin_all(self, _: Exit) -> None:
        """Exit hook: every send's blocks are let go. Finished, the transfer's verdict came, so
        every byte was read. Otherwise a send still reading them belongs to a transfer that is
        over: the decode worker never gets its end marker, so it never decodes from them."""
        for key in list(self._pins):
            self._unpin(key)

    def _unpin(self, key: int) -> None:
        blocks = self._pins.pop(key, None)
        if blocks and self._engine is not None:
            self._engine.kv.pool.free(reversed(blocks))

    def abandon(self, exit: Exit) -> None:
        """Exit hook: a prefill that did not finish stops its transfer (the engine's
        hook, which runs after this one, frees the blocks)."""
        if exit is Exit.FINISHED:
            return
        key = self.order.request.transfer_key
        # Through the link's thread (a send there may be waiting on the peer): the
        # sends still queued are skipped (`over`), the abort goes after the one running.
        reason = f"prefill ended early: {exit.value}"
        self.link.submit(key, lambda sender, _: sender.abort(key, reason), self.job.life.deadline, lambda error: None)
        # The prompt was done and its KV still in flight at the deadline, and the
        # transport raised nothing (it would have counted it): a transfer timeout.
        if exit is Exit.DEADLINE and self.output is not None and self.failed is None and self._recorder:
            self._recorder.on_failure(FailReason.TIMEOUT.value)

    def _send_blocks(self, engine: LLMEngine, blocks: range) -> None:
        rid, transfer = self.job.request_id, self.order.request.transfer_key
        src, dst = engine.blocks_of(rid), self.order.reservation.block_ids
        src_ids, dst_ids = [src[i] for i in blocks], [dst[i] for i in blocks]
        written = streams.record(self._device)  # after this step's kernels (None on the CPU)
        device, num_layers = self._device, engine.model_config.num_layers

        engine.kv.pool.touch(src_ids)  # held until the send has read them (`_pins`)
        key, self._next_pin, self._engine = self._next_pin, self._next_pin + 1, engine
        self._pins[key] = src_ids

        def send(sender: KVSender, wait_until: float) -> None:
            streams.wait_for(written, device)  # the link's stream: its gathers read these blocks after it
            for layer in range(num_layers):
                sender.send(transfer, layer, src_ids, dst_ids, wait_until)

        def done(error: TransferError | None) -> None:
            # The send returned, but a backend may read the blocks until the transfer ends (NCCL
            # gathers on its stream, ZeroMQ's I/O thread reads zero-copy frames: KVSender.send):
            # they stay held until then (`unpin_all`, when the job ends), or go now if it failed.
            if error is not None:
                self._ae.post(lambda: self._unpin(key))
            self.sent(error, last=False)

        self.link.submit(transfer, send, self.job.life.deadline, done, self.over)

    def _publish_first(self, out: RequestOutput) -> bool:
        """Send the first token to the gateway when nothing can take it back (no stop
        string to cut its text, not the request's last token); whether it went. Should
        the KV not reach the decode worker, that worker prefills the prompt itself: its
        first token, the same under greedy or a seed, is dropped by the gateway as a
        repeat, and one that differs (an unseeded draw) breaks the try, which resumes
        from what the client has (cluster/token_collector.py)."""
        c, params = out.outputs[0], self.order.request.params
        publish = (c.finish_reason == "length" and len(c.token_ids) == 1 and not params.stop
                   and (params.max_tokens is None or params.max_tokens > 1))
        if publish:  # the request goes on: the client sees this token as it does every other
            delta = dataclasses.replace(out, outputs=[dataclasses.replace(c, finish_reason=None, stop_reason=None)],
                                        finished=False)
            assert self.job.reply_to is not None
            self._first_tokens.send(self.job.reply_to, delta, self.job.attempt)
        return publish

    # -- the link's thread ------------------------------------------------------------

    def sent(self, error: TransferError | None, last: bool) -> None:
        """A queued send is done. A failure ends the request (on the engine thread).
        The end marker's verdict answers at once, from here: the first token goes
        back to the decode worker without waiting for the engine thread to finish a
        step; the job ends there after (its held blocks go back to the prefix cache)."""
        job = self.job
        if error is not None:
            self.failed = error
            self._ae.end(job, Exit.PEER_FAILED, error)
        elif last and not job.life.ended and job.ending is None:
            assert self.output is not None
            self.first = self._reply(self.output)
            self._ae.answer(job, done_notice(job.request_id))
            self._ae.post(lambda: self._ae.end_now(job, Exit.FINISHED))

    def _reply(self, out: RequestOutput) -> FirstToken:
        """The reply to the decode worker, once it verified the KV."""
        c = out.outputs[0]
        return FirstToken(
            token_id=c.token_ids[0], logprobs=c.logprobs[0] if c.logprobs else None,
            prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
            queue_time_s=out.metrics.get("queue_time_s"), published=self.published)
