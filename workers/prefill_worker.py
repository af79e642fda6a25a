"""Prefill role: compute a prompt's KV (chunked, with this worker's prefix cache),
stream it into the decode worker's reserved blocks as chunks complete, sample the
first token, and hand that token back.

A request's lifecycle here (workers/lifecycle.py): QUEUED -> PREFILLING (chunks
computed; each full block's KV leaves as it is done) -> TRANSFERRING (prompt done:
first token published, blocks held until the decode worker has verified every
block) -> FINISHED (blocks released; the first token returned to the decode worker);
any state -> ABORTED | FAILED (the sender aborts, the engine frees the blocks). The
job's role, `PrefillHandoff` (workers/prefill_handoff.py), carries one request's
handoff; this worker owns what its requests share: the links and the first-token
publisher.

The KV leaves from a thread per decode worker (`SendQueue`): the engine thread
never waits on a peer, and a dead or hung one costs its own transfers
`transfer_timeout_s` at most, or less when its link breaks. A link whose decode
worker stays unreachable and that no transfer holds is retired after
`LINK_RETIRE_S`: a restarted decode worker listens at a new address, and the old
link would reconnect for ever.

Requests that end at their first token run here alone (`serve`: no handoff).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import FirstToken, PrefillOrder, ServeRequest
from pdserve.workers.lifecycle import Exit
from pdserve.workers.prefill_handoff import FirstTokens, PrefillHandoff
from pdserve.workers.role_worker import RoleWorker
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.transfer.auth import ClusterSecret, RefusalCounts
from pdserve.workers.transfer.base import KVSender
from pdserve.workers.transfer.network_sender import NetworkSender
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


class PrefillWorker(RoleWorker):
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
        super().__init__(engine, async_engine, worker_id)
        self.transfer_recorder = transfer_recorder
        self.transfer_timeout_s = transfer_timeout_s
        self.link_retire_s = link_retire_s
        self._links: dict[str, SendQueue] = {}
        self._links_lock = threading.Lock()  # the event loop opens links, their own threads retire them
        self._retired = LinkCounts()  # retired links' counters still count
        self._first_tokens = FirstTokens(worker_id, secret)
        self._sender_for = sender_for
        self._device = engine.kv_caches[0][0].device

    def close_role(self) -> None:
        """Close what the prefill role holds (its links, their threads and senders, the
        first-token publisher), not the engine: for a worker that takes another role."""
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            link.close()
            link.sender.close()
        self._first_tokens.close()

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        """Prefill `order.request`, send its KV into the reserved blocks (those the
        decode worker caches are skipped), return its first token once the decode
        worker has verified all of it. Raises TransferError, RequestTimeoutError or
        RequestAbortedError on failure, with every block freed."""
        req = order.request
        params = _first_token_params(req.params)
        ae = self.async_engine
        job = ae.open_stream(req)
        held: SendQueue | None = None  # the link, until its release is the exit hook's
        try:
            link = held = self.link_to(order.kv_address)  # held by this transfer until its exit hook is done with it
            handoff = PrefillHandoff(job, order, link, ae, self._first_tokens, self.transfer_recorder, self._device,
                                     self.engine.config.block_size)
            job.role = handoff
            job.life.on_exit(handoff.unpin_all)  # after `abandon` (hooks run last added first)
            job.life.on_exit(handoff.abandon)
            job.life.on_exit(lambda _: link.release())
            held = None
        except BaseException:
            # No link (a thread or socket it could not make), or the job ended meanwhile (its
            # engine died: its hooks refused). Nothing else would end it, nor release the link.
            if held is not None:
                held.release()
            ae.end(job, Exit.ABORTED)
            raise
        ae.begin(job, lambda e, life: e.add_request(req.request_id, list(req.prompt_token_ids), params, hold_kv=True,
                                                    life=life))
        await ae.finished(job)
        assert handoff.first is not None, "a finished prefill without its first token"
        return handoff.first

    async def serve(self, req: ServeRequest) -> None:
        """The whole request here, no handoff: for requests that end at their first
        token (max_tokens 1: classification, scoring a prompt), where reserving
        decode blocks and shipping the KV would buy nothing."""
        if req.params.max_tokens != 1:
            raise ValueError(f"max_tokens: a prefill worker serves requests of 1 token, got {req.params.max_tokens}")
        await self.async_engine.serve(req)

    def link_to(self, address: str) -> SendQueue:
        """The send queue (and its thread) to the decode worker at `address`, held
        for the caller: `release` it when done."""
        with self._links_lock:
            link = self._links.get(address)
            if link is not None and link.hold():
                return link
            sender = self._sender_for(address)
            if self.transfer_recorder is not None:
                sender = RecordingSender(sender, self.engine.transfer_kv, self.transfer_recorder)
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


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """The prefill's share of a request: one token, the final output only, no stop
    strings (the decode worker matches them over the whole text)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                               output_kind=RequestOutputKind.FINAL_ONLY)
