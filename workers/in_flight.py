"""A step in flight: queued on the device, its sampled tokens not yet read on the host.

Async scheduling (vLLM's name; SGLang's overlap scheduler) keeps the host off the
device's critical path. The engine launches step N+1 before it reads step N's tokens:

    schedule N+1 -> stage its inputs, queue its forward and sampling -> read N's tokens
    (stop checks, text, outputs) -> advance N+1's requests -> return N's outputs

so the host's work for step N (and the scheduling of N+1) runs while the device computes
N+1. A request decoding in both steps has no token on the host for N+1's input: it counts
one pending token (`Request.num_pending`) and its input id is copied on the device from
N's sampled tokens (`TokenFeed`), which reach the host once, by a non-blocking copy that
`landed` waits for. A request that N's tokens finish (a stop string, EOS) has a row in
N+1 that is computed and dropped; a request whose last token N is known to be
(max_tokens) gets no row.

Only a step whose successor needs nothing of its tokens on the host chains: no drafts to
verify (the next drafts come from the accepted tokens), no grammar (the next mask needs the
grammar advanced by the token), no penalties (they count the output tokens). A step with
any of those is landed before the next is scheduled, as the synchronous engine does. With a
speculator, a step chains only while it is dormant (more decoding requests than
`spec_max_batch_size`, or drafts that do not pay): a request with a token in flight drafts
nothing, so once the batch shrinks the step after lands first, and drafting resumes from
the tokens on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.workers.model_runner import StepResult
from pdserve.workers.sampler import SamplerOutput
from pdserve.workers.scheduler import SchedulerOutput
from pdserve.workers.stats import StepStats


@dataclass
class TokenFeed:
    """The tokens a step in flight sampled, on the device, for the next step's inputs."""

    tokens: torch.Tensor  # [rows] int64, on the device; NO_TOKEN (-1) where a row had no valid token
    rows: dict[int, int]  # id(request) -> its row in `tokens`


@dataclass
class InFlight:
    sched: SchedulerOutput
    result: StepResult  # its output's tensors are host copies that are complete once `ready` is
    feed: TokenFeed
    work: StepStats
    start: float  # perf_counter() when it was launched
    chainable: bool  # the next step may be launched before this one lands
    # Prompt tokens computed of each scheduled request before this step: what a prefill
    # worker may send while the step is in flight.
    computed_before: dict[str, int]
    ready: torch.cuda.Event | None = None  # after the copies of its outputs to the host (CUDA)

    def landed(self) -> StepResult:
        """Its result, once its outputs are on the host (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.result


def launch_record(sched: SchedulerOutput, result: StepResult, work: StepStats, start: float,
                  chainable: bool, computed_before: dict[str, int] | None) -> InFlight:
    """The in-flight record of a step just queued. With `computed_before` (async scheduling) its
    sampled tokens stay on the device for the next step's inputs, and a non-blocking copy takes
    its outputs to the host; without (it lands at once) none of that is needed."""
    if computed_before is None:
        return InFlight(sched, result, TokenFeed(result.output.token_ids, {}), work, start, False, {})
    device_tokens = result.output.token_ids
    result.output, ready = _copy_to_host(result.output)
    feed = TokenFeed(device_tokens, {id(r): i for i, r in enumerate(result.sampled)})
    return InFlight(sched, result, feed, work, start, chainable, computed_before, ready)


def chains(result: StepResult, drafting: bool) -> bool:
    """Whether the step after `result`'s may be launched before it lands (the module's docstring);
    `drafting`: the engine's speculator may draft for the next step."""
    if drafting or result.spec:
        return False
    return all(r.grammar is None and not r.params.depends_on_history for r in result.sampled)


def _copy_to_host(out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """The sampler's outputs on the host: on CUDA, pinned copies queued behind the step (no
    sync) and the event after them; on CPU, the outputs themselves."""
    if out.token_ids.device.type != "cuda":
        return out, None

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy.copy_(t, non_blocking=True)
        return copy

    tokens = host(out.token_ids)
    assert tokens is not None
    hosted = SamplerOutput(tokens, host(out.sampled_logprob), host(out.top_ids), host(out.top_logprobs))
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return hosted, ready
