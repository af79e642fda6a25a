"""Prefill role: compute a prompt's KV (chunked, with this worker's prefix cache),
stream it into the decode worker's reserved blocks as chunks complete, sample the
first token, and hand that token back.

A request's lifecycle here (workers/lifecycle.py):

    QUEUED -> PREFILLING (chunks computed; each full block's KV leaves as it is done)
           -> TRANSFERRING (prompt done, first token sampled and published on the
              gateway's token stream when nothing can take it back: no stop string
              to cut its text, not the last token; blocks held until the decode
              worker has verified every block)
              (the KV leaves from a thread per decode worker, `SendQueue`: the engine
              thread never waits on a peer, and a dead or hung one costs its own
              transfers `transfer_timeout_s` at most, or less when its link breaks;
              the engine thread records what to send and an event after the step
              that wrote it; the link's thread gathers on a CUDA stream of its own
              once that event is passed: `workers/transfer/streams.py`;
              a link whose decode worker stays unreachable and that no transfer
              holds is retired after `LINK_RETIRE_S`: a restarted decode worker
              listens at a new address, and the old link would reconnect for ever)
           -> FINISHED: blocks released; the first token returned to the decode worker
    any state -> ABORTED (the decode worker or gateway aborted) | FAILED (deadline,
              transfer error): the sender aborts, the engine frees the blocks.

Requests that end at their first token run here alone (`serve`: no handoff).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.workers.async_engine import AsyncEngine, Job, done_notice
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import FirstToken, PrefillOrder, ServeRequest
from pdserve.workers.lifecycle import Exit, RequestState
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.token_stream import TokenStreamPublisher
from pdserve.workers.transfer import streams
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts
from pdserve.workers.transfer.base import FailReason, KVSender, TransferError
from pdserve.workers.transfer.control import NetworkSender
from pdserve.workers.transfer.recording import RecordingSender, TransferRecorder
from pdserve.workers.transfer.send_queue import SendQueue
from pdserve.workers.transfer.streams import CopyStream

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
# Past the transports' connect budget (5 s: transfers on the link have failed by then),
# so a blip that heals keeps its link; what it costs to be wrong is one reconnect.
LINK_RETIRE_S = 10.0


@dataclass(frozen=True)
class LinkCounts:
    """A network link's failure counters (`NetworkSender`): 0 for other transports."""

    links_lost: int = 0
    resyncs: int = 0
    refused: RefusalCounts = field(default_factory=RefusalCounts)  # messages from the receiver it dropped

    @staticmethod
    def of(sender: KVSender) -> LinkCounts:
        inner = sender.inner if isinstance(sender, RecordingSender) else sender
        if not isinstance(inner, NetworkSender):
            return LinkCounts()
        return LinkCounts(inner.num_links_lost, inner.num_resyncs, inner.refusals.add(RefusalCounts()))

    def __add__(self, other: LinkCounts) -> LinkCounts:
        return LinkCounts(self.links_lost + other.links_lost, self.resyncs + other.resyncs,
                          self.refused.add(other.refused))


@dataclass(eq=False)
class _Transfer:
    """One request's KV on its way to a decode worker (engine thread)."""

    job: Job
    order: PrefillOrder
    link: SendQueue
    next_block: int  # first block not sent yet (blocks the decode worker caches are skipped)
    output: RequestOutput | None = None  # the engine's final output: the first token
    first: FirstToken | None = None  # set when the transfer succeeded
    published: bool = False  # the first token went to the gateway (when the prompt was done)
    failed: TransferError | None = None
    finishing: bool = False  # the end marker is queued: the verdict comes back through the link

    def over(self) -> bool:
        """Whether queued sends of this request should be skipped (any thread)."""
        return self.job.life.ended or self.job.ending is not None or self.failed is not None


class PrefillWorker:
    def __init__(self, engine: LLMEngine, sender_for: Callable[[str], KVSender],
                 transfer_recorder: TransferRecorder | None = None, worker_id: str = "prefill",
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
                 link_retire_s: float | None = LINK_RETIRE_S, secret: ClusterSecret | None = None,
                 async_engine: AsyncEngine | None = None) -> None:
        """`sender_for(address)` makes a sender to a decode worker's receiver, once per
        link (again after a link was retired); this worker closes it.
        `transfer_recorder` hears of every handoff: its bytes and duration, and
        its failures (the transport's, through `RecordingSender`, and this
        worker's own deadline). `transfer_timeout_s`: the longest one send may
        wait on its decode worker (a credit, the verdict) before the transfer fails.
        `link_retire_s`: how long an idle link's peer may stay unreachable before the
        link is closed (None: never). `secret` signs the first tokens it sends
        to gateways (None: `auth.default_secret()`). `async_engine`: the engine's thread when
        the worker already has one (a worker that changes role keeps its engine and thread)."""
        self.transfer_recorder = transfer_recorder
        self.transfer_timeout_s = transfer_timeout_s
        self.link_retire_s = link_retire_s
        self._links: dict[str, SendQueue] = {}
        self._links_lock = threading.Lock()  # the event loop opens links, their own threads retire them
        self._retired = LinkCounts()  # retired links' counters still count
        self._first_tokens = TokenStreamPublisher(f"{worker_id}-first", secret=secret)
        self._first_lock = threading.Lock()
        self._sender_for = sender_for
        self.async_engine = async_engine or AsyncEngine(engine, worker_id=worker_id)
        self.engine = engine
        self._device = engine.kv_caches[0][0].device

    def start(self) -> PrefillWorker:
        self.async_engine.start()
        return self

    def close(self) -> None:
        self.async_engine.close()
        self.close_role()

    def close_role(self) -> None:
        """Close what the prefill role holds (its links, their threads and senders, the
        first-token publisher), not the engine: for a worker that takes another role."""
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            link.close()
            link.sender.close()
        with self._first_lock:
            self._first_tokens.close()

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        """Prefill `order.request`, send its KV into the reserved blocks (those the
        decode worker caches are skipped), return its first token once the decode
        worker has verified all of it. Raises TransferError, RequestTimeoutError or
        RequestAbortedError on failure, with every block freed."""
        req = order.request
        params = _first_token_params(req.params)
        ae = self.async_engine
        skip = order.reservation.skip_blocks(self.engine.config.block_size)
        job = ae.open_stream(req)
        link = self.link_to(order.kv_address)  # held by this transfer until its exit hook is done with it
        t = _Transfer(job, order, link, skip)
        job.on_output = lambda out: setattr(t, "output", out)
        job.after_step = lambda engine: self._pump(engine, t)
        job.life.on_exit(lambda exit: self._abandon(t, exit))
        job.life.on_exit(lambda _: link.release())
        ae.begin(job, lambda e: e.add_request(req.request_id, list(req.prompt_token_ids), params, hold_kv=True))
        await ae.finished(job)
        assert t.first is not None, "a finished prefill without its first token"
        return t.first

    async def serve(self, req: ServeRequest) -> None:
        """The whole request here, no handoff: for requests that end at their first
        token (max_tokens 1: classification, scoring a prompt), where reserving
        decode blocks and shipping the KV would buy nothing."""
        if req.params.max_tokens != 1:
            raise ValueError(f"max_tokens: a prefill worker serves requests of 1 token, got {req.params.max_tokens}")
        await self.async_engine.serve(req)

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        self.async_engine.abort(request_id, attempt)

    def link_to(self, address: str) -> SendQueue:
        """The send queue (and its thread) to the decode worker at `address`, held
        for the caller: `release` it when done."""
        with self._links_lock:
            link = self._links.get(address)
            if link is not None and link.hold():
                return link
            sender = self._sender_for(address)
            if self.transfer_recorder is not None:
                sender = RecordingSender(sender, self.engine.kv_caches, self.transfer_recorder)
            link = SendQueue(sender, self.transfer_timeout_s, name=f"kv-send {address}",
                             retire_after_s=self.link_retire_s, on_retire=lambda q: self._retire(address, q),
                             stream=CopyStream(self._device))
            link.hold()
            self._links[address] = link
            return link

    def link_counts(self) -> LinkCounts:
        """Connections lost and resynced on every link this worker has had (retired ones too)."""
        with self._links_lock:
            return sum((LinkCounts.of(link.sender) for link in self._links.values()), self._retired)

    @property
    def num_links(self) -> int:
        with self._links_lock:
            return len(self._links)

    def _retire(self, address: str, link: SendQueue) -> None:
        """The link's thread: it closed itself (its peer stayed unreachable)."""
        with self._links_lock:
            if self._links.get(address) is link:
                del self._links[address]
            self._retired += LinkCounts.of(link.sender)

    # -- engine thread -----------------------------------------------------------

    def _pump(self, engine: LLMEngine, t: _Transfer) -> None:
        """After a step: queue the sends of what is ready; once the prompt is done,
        the end marker (the verdict comes back through `_sent`)."""
        progress = engine.prefill_progress(t.job.request_id)
        if progress is None or t.job.life.ended or t.finishing:
            return
        computed, done = progress
        bs = engine.config.block_size
        ready = -(-computed // bs) if done else computed // bs
        rid, deadline = t.job.request_id, t.job.life.deadline
        if ready > t.next_block:
            src, dst = engine.blocks_of(rid), t.order.reservation.block_ids
            blocks = range(t.next_block, ready)
            src_ids, dst_ids = [src[i] for i in blocks], [dst[i] for i in blocks]
            written = streams.record(self._device)  # after this step's kernels (None on the CPU)

            def send(sender: KVSender, wait_until: float) -> None:
                streams.wait_for(written, self._device)  # the link's stream: its gathers read these blocks after it
                for layer in range(engine.model_config.num_layers):
                    sender.send(rid, layer, src_ids, dst_ids, wait_until)

            t.link.submit(rid, send, deadline, lambda error: self._sent(t, error, last=False), t.over)
            t.next_block = ready
        if done:
            assert t.output is not None, "the prompt is done but its first token never came"
            t.job.life.advance(RequestState.TRANSFERRING)
            t.finishing = True
            # The client has its first token now, not after the KV's verdict: the time
            # the last layers and the verdict take is off its TTFT.
            t.published = self._publish_first(t, t.output)
            t.link.submit(rid, lambda sender, wait_until: sender.finish(rid, wait_until), deadline,
                          lambda error: self._sent(t, error, last=True), t.over)

    def _sent(self, t: _Transfer, error: TransferError | None, last: bool) -> None:
        """The link's thread: a queued send is done. A failure ends the request (on
        the engine thread). The end marker's verdict answers at once, from here: the
        first token goes back to the decode worker without waiting for the engine
        thread to finish a step; the job ends there after (its held blocks go back
        to the prefix cache)."""
        if error is not None:
            t.failed = error
            self.async_engine.end(t.job, Exit.PEER_FAILED, error)
        elif last and not t.job.life.ended and t.job.ending is None:
            assert t.output is not None
            t.first = self._first_token(t, t.output)
            self.async_engine.answer(t.job, done_notice(t.job.request_id))
            self.async_engine.post(lambda: self.async_engine.end_now(t.job, Exit.FINISHED))

    def _publish_first(self, t: _Transfer, out: RequestOutput) -> bool:
        """Engine thread, the prompt done: send the first token to the gateway when
        nothing can take it back (no stop string to cut its text, not the request's
        last token); whether it went. Should the KV not reach the decode worker, that
        worker prefills the prompt itself: its first token, the same under greedy or a
        seed, is dropped by the gateway as a repeat, and one that differs (an unseeded
        draw) breaks the try, which resumes from what the client has (token_stream.py)."""
        c, params = out.outputs[0], t.order.request.params
        publish = (c.finish_reason == "length" and len(c.token_ids) == 1 and not params.stop
                   and (params.max_tokens is None or params.max_tokens > 1))
        if publish:  # the request goes on: the client sees this token as it does every other
            delta = dataclasses.replace(out, outputs=[dataclasses.replace(c, finish_reason=None, stop_reason=None)],
                                        finished=False)
            assert t.job.reply_to is not None
            with self._first_lock:  # the engine thread has its own publisher for whole requests
                self._first_tokens.add(t.job.reply_to, delta, 0, t.job.attempt)
                self._first_tokens.flush()
        return publish

    @staticmethod
    def _first_token(t: _Transfer, out: RequestOutput) -> FirstToken:
        """The reply to the decode worker, once it verified the KV."""
        c = out.outputs[0]
        return FirstToken(
            token_id=c.token_ids[0], logprobs=c.logprobs[0] if c.logprobs else None,
            prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
            queue_time_s=out.metrics.get("queue_time_s"), published=t.published)

    def _abandon(self, t: _Transfer, exit: Exit) -> None:
        """Exit hook: a prefill that did not finish stops its transfer (the engine
        hook, which runs after this one, frees the blocks)."""
        if exit is Exit.FINISHED:
            return
        # Through the link's thread (a send there may be waiting on the peer): the
        # sends still queued are skipped (`t.over`), the abort goes after the one running.
        reason = f"prefill ended early: {exit.value}"
        t.link.submit(t.job.request_id, lambda sender, _: sender.abort(t.job.request_id, reason), t.job.life.deadline,
                      lambda error: None)
        # The prompt was done and its KV still in flight at the deadline, and the
        # transport raised nothing (it would have counted it): a transfer timeout.
        if exit is Exit.DEADLINE and t.output is not None and t.failed is None and self.transfer_recorder:
            self.transfer_recorder.on_failure(FailReason.TIMEOUT.value)


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """The prefill's share of a request: one token, the final output only, no stop
    strings (the decode worker matches them over the whole text)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                               output_kind=RequestOutputKind.FINAL_ONLY)
