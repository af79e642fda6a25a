"""The typed records one request's way through the cluster is made of.

    gateway --ServeRequest--> worker                    (its inbox: run it, stream its tokens to reply_to)
    decode worker --PrefillOrder--> prefill worker      (handoff: prefill into my reserved blocks)
    prefill worker --FirstToken--> decode worker        (the reply: the prompt's first output token)

Every token reaches the gateway the same way: as `TokenDelta`s on its token
stream (workers/token_stream.py), from whichever worker produced it. These
records travel as Ray call arguments and results (a ServeRequest from the gateway
as a signed msgpack message: workers/inbox_wire.py); they are frozen, so nothing
downstream can change what the gateway decided.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pdserve.workers.sampling_params import SamplingParams

LogprobEntry = dict[int, float]


class KVFailurePolicy(str, enum.Enum):
    """What a decode worker does when a prompt's KV does not come (the prefill worker failed,
    the transfer broke or timed out). A setting: here, not in workers/decode_worker.py, so that
    reading it imports no engine."""

    RECOMPUTE = "recompute"  # prefill the prompt here instead (the default)
    FAIL = "fail"  # fail the request with a clear error


@dataclass(frozen=True)
class Resume:
    """What a request already streamed to its client before its worker died. The
    worker that takes it over computes prompt + these tokens (as it would for a
    preempted request) and goes on from there: the client sees no token twice and
    none missing."""

    token_ids: tuple[int, ...]
    text_chars: int  # characters of text the client already has: new text starts after them
    cumulative_logprob: float | None = None  # of `token_ids`, when the request asks for logprobs

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("resume: no tokens to resume from")
        if self.text_chars < 0:
            raise ValueError(f"resume.text_chars: must be >= 0, got {self.text_chars}")


# A TCP endpoint as ZeroMQ connects to it: a host name, an IPv4 address or a bracketed IPv6 one.
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def check_endpoint(name: str, address: str) -> None:
    """ValueError naming `name` unless `address` is tcp://host:port: a worker connects to
    what a peer names (a gateway's token stream), and ZeroMQ raises at the connect."""
    m = _ENDPOINT.fullmatch(address) if isinstance(address, str) else None
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise ValueError(f"{name}: must be tcp://host:port, got {str(address)[:64]!r}")


@dataclass(frozen=True)
class ServeRequest:
    """What a gateway asks a worker to run, and where its tokens go."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    timeout_s: float  # from arrival at the worker; each hop measures its own deadline from it
    reply_to: str  # the gateway's token stream (tcp://host:port)
    # Which try of the request this is (0 first; one more per migration): deltas
    # carry it, so the gateway drops the late deltas of a try it gave up on.
    attempt: int = 0
    resume: Resume | None = None  # a migrated request: the output its client already has

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.attempt < 0:
            raise ValueError(f"attempt: must be >= 0, got {self.attempt}")
        if self.reply_to is not None:
            check_endpoint("reply_to", self.reply_to)

    @property
    def offset(self) -> int:
        """Output tokens the client has before this try's first delta."""
        return len(self.resume.token_ids) if self.resume is not None else 0

    @property
    def transfer_key(self) -> str:
        """The id this try's KV transfer goes by on both workers: `transfer_key`."""
        return transfer_key(self.request_id, self.attempt)


def transfer_key(request_id: str, attempt: int) -> str:
    """What a try's KV transfer is registered and sent under: each try of a request its own
    (the gateway's request ids have no '@'). A later try on the same decode worker would
    otherwise share the earlier one's id, and a late message or abort of the earlier try's
    transfer would land on the later try's registration and fail it."""
    return f"{request_id}@{attempt}"


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker reserved for a prompt whose KV a prefill worker computes."""

    block_ids: tuple[int, ...]  # covering the whole prompt, in token order
    cached_tokens: int  # leading prompt tokens already cached on the decode worker: their blocks are not sent

    def skip_blocks(self, block_size: int) -> int:
        """Leading blocks that need no transfer."""
        return self.cached_tokens // block_size


@dataclass(frozen=True)
class PrefillOrder:
    """Decode worker -> prefill worker: prefill `request` into `reservation` at `kv_address`."""

    request: ServeRequest
    reservation: Reservation
    kv_address: str  # the decode worker's KV receiver


@dataclass(frozen=True)
class FirstToken:
    """Prefill worker -> decode worker: the first token it sampled, once the KV is all sent."""

    token_id: int
    logprobs: LogprobEntry | None  # its entry, when the request asks for logprobs
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None  # when the request asks for them
    queue_time_s: float | None  # how long the request queued on the prefill worker (its first queue)
    # The prefill worker already sent it to the gateway's token stream: the decode
    # worker must not send it again. False when its text could still be cut by a
    # stop string, or it may be the last token: the decode worker decides then.
    published: bool
