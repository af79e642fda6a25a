"""A request's sampled tokens in, its outputs out: the per-token half of an engine step.

`append_token` adds one token to a request and says why it ends the request, if it does
(stop tokens and strings, the grammar's end, length); `request_output` builds what a step
returns for it (the text a stop string may still claim held back). Both read and write only
the `Request`: the engine's scheduler decides what a finished request's blocks become.
"""

from __future__ import annotations

from pdserve.workers.handoff import LogprobEntry, Resume
from pdserve.workers.inputs import check_token_ids
from pdserve.workers.model_runner import PromptLogprobs
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.request import FinishReason, Request
from pdserve.workers.sampler import SamplerOutput
from pdserve.workers.sampling_params import RequestOutputKind


def append_token(req: Request, token: int, entry: LogprobEntry | None, max_model_len: int) -> FinishReason | None:
    """Add a generated token (and its logprobs entry); why it ends the request, if it does."""
    req.append_token(token)
    if req.grammar is not None:
        req.grammar.accept(token)  # a token it refuses fails the request (raises)
    if req.logprobs is not None and entry is not None:
        req.logprobs.append(entry)
        req.cumulative_logprob += entry.get(token, 0.0)
    may_stop = req.num_output_tokens >= req.params.min_tokens
    stop_token = may_stop and token in req.stop_token_ids
    stop_str = None
    if req.detok is not None and (not stop_token or req.params.include_stop_str_in_output):
        # A stop token's (EOS's) text is left out of the output, as vLLM leaves it, unless
        # include_stop_str_in_output; the token itself is among the output's tokens. Stop
        # strings count once the output is past min_tokens (vLLM's rule: its stop tokens are
        # banned for the first min_tokens, so neither ends the output before token min_tokens + 1).
        # A stop token's own text is not searched (vLLM's): it ends the output whole.
        stop_str = req.detok.add(token, req.num_output_tokens > req.params.min_tokens and not stop_token)
    if may_stop:
        if stop_token:
            req.stop_reason = token if token in (req.params.stop_token_ids or ()) else None
            return ended(req, FinishReason.STOP)
        if stop_str is not None:
            req.stop_reason = stop_str
            return FinishReason.STOP
    if req.grammar is not None and req.grammar.terminated:  # it allows nothing more (ignore_eos too)
        return ended(req, FinishReason.STOP)
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return ended(req, FinishReason.LENGTH)
    return None


def ended(req: Request, reason: FinishReason) -> FinishReason:
    """`reason`, once the text of a character the end cut into is out (detokenizer `finish`).
    Not on a prefill worker's share of a handed-off request (`hold_kv`): its end is the first
    token's, and the decode worker goes on with the character."""
    if req.detok is not None and not req.hold_kv:
        req.detok.finish()
    return reason


def request_output(req: Request) -> RequestOutput:
    """`req`'s output now: whole, or (DELTA) what it did not show before."""
    text = req.detok.text if req.detok is not None else ""
    token_ids, logprobs, prompt_logprobs = req.output_token_ids, req.logprobs, req.prompt_logprobs
    detok = req.detok
    # A stop string may begin in the text not yet shown: what an output shows cannot be taken
    # back, so a running request's last characters wait until they cannot be the start of one
    # (vLLM holds back the same, in cumulative outputs too: the longest stop string less one
    # character). The tokens go now; their text follows.
    hold = (detok.max_stop_len - 1 if not req.finished and detok is not None and detok.stop
            and not detok.include_stop else 0)
    if req.params.output_kind is RequestOutputKind.CUMULATIVE and hold:
        text = text[:max(0, len(text) - hold)]
    if req.params.output_kind is RequestOutputKind.DELTA:
        if req.sent_any:
            prompt_logprobs = None  # they went with the first delta
        sent_tokens, sent_chars = req.sent_tokens, req.sent_chars
        upto = max(sent_chars, len(text) - hold)
        req.sent_tokens, req.sent_chars, req.sent_any = len(token_ids), upto, True
        token_ids, text = token_ids[sent_tokens:], text[sent_chars:upto]
        logprobs = logprobs[sent_tokens:] if logprobs is not None else None
    completion = CompletionOutput(
        index=0, text=text, token_ids=token_ids,
        cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
        logprobs=logprobs, finish_reason=req.finish_reason.value if req.finish_reason else None,
        stop_reason=req.stop_reason,
    )
    metrics = {} if req.queue_time_s is None else {"queue_time_s": req.queue_time_s}
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         finished=req.finished, num_cached_tokens=max(req.num_cached_tokens, 0),
                         metrics=metrics, prompt_logprobs=prompt_logprobs)


def resume_output(req: Request, resume: Resume, vocab_size: int) -> None:
    """Take `resume`'s tokens as `req`'s output already handed out: the request
    computes them with its prompt in its first steps (as a preempted one does)
    and its next token follows them. A seeded request's draws depend only on
    its seed and position (the sampler reseeds per position), so it goes on as
    it would have."""
    tokens = check_token_ids(list(resume.token_ids), vocab_size)
    if len(tokens) >= req.max_tokens:
        raise ValueError(f"resume: {len(tokens)} tokens already leave no room for more (max {req.max_tokens})")
    for token in tokens:
        req.append_token(token)
        if req.detok is not None:
            req.detok.add(token, match_stop=False)  # a stop string in them would have ended the request
    if req.detok is not None and resume.text_chars > len(req.detok.text):
        raise ValueError(f"resume: {resume.text_chars} characters sent, but the tokens make "
                         f"{len(req.detok.text)}")
    if req.logprobs is not None:
        req.logprobs += [{} for _ in tokens]  # handed out already: never sent again
        req.cumulative_logprob = resume.cumulative_logprob or 0.0
    req.sent_tokens, req.sent_chars, req.sent_any = len(tokens), resume.text_chars, True


def logprob_entries(out: SamplerOutput, tokens: list[int], top_n: list[int]) -> list[LogprobEntry | None]:
    """Per sampled row: {token id: raw log-prob} of its top-N and its own token (None without logprobs)."""
    if out.sampled_logprob is None:
        return [None] * len(tokens)
    sampled = out.sampled_logprob.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    entries: list[LogprobEntry | None] = []
    for row, token in enumerate(tokens):
        n = top_n[row]
        entry = dict(zip(top_ids[row][:n], top_lp[row][:n])) if top_ids and top_lp else {}
        entry[token] = sampled[row]
        entries.append(entry)
    return entries


def record_prompt_logprobs(scored: PromptLogprobs) -> None:
    """Add a step's scored prompt tokens to their request's prompt logprobs, in order."""
    entries = scored.request.prompt_logprobs
    assert entries is not None and len(entries) == scored.first, "prompt tokens scored out of order"
    for i, lp in enumerate(scored.token_logprobs):
        entry = dict(zip(scored.top_ids[i], scored.top_logprobs[i]))
        entry[scored.request.prompt_token_ids[scored.first + i]] = lp
        entries.append(entry)
