"""What a request may ask for, checked once: the engine and the gateway both use
these, so a bad request gets the same `ValueError` (its message starts with
the offending parameter's name) wherever it is caught."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.workers.sampling_params import SamplingParams

# vLLM's prompt shapes (vllm/inputs/parse.py, `parse_singleton_prompt`): a string, a
# TokensPrompt {"prompt_token_ids": [int, ...]} or a TextPrompt {"prompt": str}; a dict
# with both is a TokensPrompt (the ids win, as in vLLM). vLLM >= 0.10 refuses a bare
# list of ids (a TypeError: it takes the list for a batch of ints); pdserve keeps
# taking one as a prompt (its own API before vLLM's shapes, used across its tests and
# benches): no call that vLLM accepts means anything else here.
_PROMPT_KEYS = ("prompt_token_ids", "prompt")


def is_one_prompt(prompts: Any) -> bool:
    """Whether `prompts` is a single prompt rather than a sequence of them (vLLM:
    a str or a dict is one; pdserve: a list of ints too)."""
    if not isinstance(prompts, (list, tuple)):
        return True  # a str, a dict, or what `prompt_of` will refuse with a clear message
    return bool(prompts) and isinstance(prompts[0], int)


def prompt_of(p: Any) -> str | list[int]:
    """One prompt in any of the accepted shapes, as text or token ids; ValueError naming `prompts`."""
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)) and all(type(t) is int for t in p):
        return list(p)
    if isinstance(p, Mapping):
        # vLLM's other keys (multi_modal_data, prompt_embeds, ...) ask for what pdserve
        # cannot do: refused, not dropped, so nothing changes silently. (A cache salt is
        # SamplingParams(cache_salt=...) here; vLLM puts it in the prompt dict.)
        if other := sorted(map(str, set(p) - set(_PROMPT_KEYS))):
            raise ValueError(f"prompts: a prompt dict takes {list(_PROMPT_KEYS)}; pdserve does not support {other}")
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
            if isinstance(ids, (list, tuple)) and all(type(t) is int for t in ids):
                return list(ids)
            raise ValueError(f"prompts: prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        if "prompt" in p:
            text = p["prompt"]
            if isinstance(text, str):
                return text
            raise ValueError(f"prompts: prompt must be a string, got {type(text).__name__}")
    raise ValueError(f"prompts: a prompt is a string, {{'prompt': str}}, {{'prompt_token_ids': [int, ...]}} "
                     f"or a list of token ids, got {type(p).__name__}")


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids: not empty, every id in the vocabulary."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("prompt: must not be empty")
    if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    return ids


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context's length;
    None: all of them). More than the context holds is refused, as vLLM refuses it."""
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} is more than the model's context ({max_model_len} tokens)")
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


class ContextOverflowError(ValueError):
    """A prompt (with its max_tokens) that the model's context cannot hold."""


def max_new_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many tokens a request may generate: its `max_tokens`, or all the
    context left. ValueError if the prompt and `max_tokens` do not fit."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise ContextOverflowError(f"prompt: this model's maximum context length is {max_model_len} tokens; "
                                   f"the prompt has {n}, which leaves no room to generate")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ContextOverflowError(f"max_tokens: this model's maximum context length is {max_model_len} tokens; "
                                   f"you requested {n + max_tokens} ({n} in the prompt, {max_tokens} in the "
                                   "completion)")
    return max_tokens if max_tokens is not None else max_model_len - n


# The most top log-probs a request may ask for per token (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20


def check_request(params: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
    # (max_logprobs -1: the vocabulary's size, vLLM's meaning)
    """What of `params` depends on the model: every token id it names in the vocabulary,
    top_k no wider than it, logprobs within `max_logprobs`. With SamplingParams' own
    checks, the one gate between a request's values and the engine thread: the gateway
    runs it before admitting a request (a 400) and the engine before adding one (a
    ValueError), so no value reaches the sampler that it cannot take."""
    if params.top_k > vocab_size:
        raise ValueError(f"top_k: must be -1 or 0 (disabled) or in [1, {vocab_size}] (the vocabulary), "
                         f"got {params.top_k}")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab_size})")
    if params.allowed_token_ids and params.allowed_token_ids[-1] >= vocab_size:  # sorted
        raise ValueError(f"allowed_token_ids: token id {params.allowed_token_ids[-1]} is not in the vocabulary "
                         f"[0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids or ()):
        raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab_size})")
    most = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > most:
            raise ValueError(f"{name}: at most {most}, got {value}")


# What the chat template renderer (transformers' apply_chat_template) takes as its own arguments,
# and the variable the messages are: a request sets those it may through its own fields, checked
# there. Through chat_template_kwargs they would pass unchecked (tools, add_generation_prompt) or
# change what the renderer returns (tokenize, return_dict: not the prompt's text). vLLM refuses
# chat_template and tokenize there.
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def json_object(value: object, name: str) -> dict[str, Any]:
    """A setting given as a JSON object: its text (a flag's) parsed, or the mapping itself (a YAML's,
    a Python caller's). ValueError naming `name` when it is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not a JSON object: {e}") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name}: a JSON object, got {value!r}"[:200])
    return dict(value)


def check_template_kwargs(kwargs: dict[str, object] | None, name: str = "chat_template_kwargs") -> dict[str, object]:
    """vLLM's `chat_template_kwargs` (or the server's defaults of them, setting `name`): more
    variables for the chat template (Qwen3's `{"enable_thinking": false}`); a ValueError naming
    the field for one the renderer takes as its own argument."""
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"{name}: must be a mapping of variable names to values")
    taken = sorted(TEMPLATE_ARGUMENTS.intersection(kwargs or ()))
    if taken:
        raise ValueError(f"{name}: {', '.join(map(repr, taken))} cannot be set here (the request's own "
                         "fields set what they may: tools, add_generation_prompt, continue_final_message)")
    return dict(kwargs or {})
