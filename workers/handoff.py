"""The typed records one request's way through the cluster is made of.

    gateway --ServeRequest--> worker                    (one RPC: run it, stream its tokens to reply_to)
    decode worker --PrefillOrder--> prefill worker      (handoff: prefill into my reserved blocks)
    prefill worker --FirstToken--> decode worker        (the reply: the prompt's first output token)

Every token reaches the gateway the same way: as `TokenDelta`s on its token
stream (workers/token_stream.py), from whichever worker produced it. These
records travel as Ray call arguments and results; they are frozen, so nothing
downstream can change what the gateway decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.workers.sampling_params import SamplingParams

LogprobEntry = dict[int, float]


@dataclass(frozen=True)
class ServeRequest:
    """What a gateway asks a worker to run, and where its tokens go."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    timeout_s: float  # from arrival at the worker; each hop measures its own deadline from it
    reply_to: str  # the gateway's token stream (tcp://host:port)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")


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
