"""What a request may ask for, checked once: the engine and the gateway both use
these, so a bad request gets the same `ValueError` (its message starts with
the offending parameter's name) wherever it is caught."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.workers.sampling_params import SamplingParams

# vLLM's prompt shapes: a string, a TextPrompt {"prompt": str} or a TokensPrompt
# {"prompt_token_ids": [int, ...]}; and, as pdserve always took, a bare list of ids.
_PROMPT_KEYS = {"prompt": str, "prompt_token_ids": list}


def is_one_prompt(prompts: Any) -> bool:
    """Whether `prompts` is a single prompt rather than a sequence of them."""
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
        keys = set(p)
        if len(keys) != 1 or not keys <= set(_PROMPT_KEYS):
            raise ValueError(f"prompts: a prompt dict takes exactly one of {sorted(_PROMPT_KEYS)}, "
                             f"got keys {sorted(map(str, keys))}")
        (key,) = keys
        value = p[key]
        if key == "prompt" and isinstance(value, str):
            return value
        if key == "prompt_token_ids" and isinstance(value, (list, tuple)) and all(type(t) is int for t in value):
            return list(value)
        raise ValueError(f"prompts: {key} must be {'a string' if key == 'prompt' else 'a list of token ids'}, "
                         f"got {type(value).__name__}")
    raise ValueError(f"prompts: a prompt is a string, a list of token ids, {{'prompt': str}} or "
                     f"{{'prompt_token_ids': [int, ...]}}, got {type(p).__name__}")


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids: not empty, every id in the vocabulary."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("prompt: must not be empty")
    if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    return ids


def max_new_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many tokens a request may generate: its `max_tokens`, or all the
    context left. ValueError if the prompt and `max_tokens` do not fit."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise ValueError(f"prompt: this model's maximum context length is {max_model_len} tokens; "
                         f"the prompt has {n}, which leaves no room to generate")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: this model's maximum context length is {max_model_len} tokens; "
                         f"you requested {n + max_tokens} ({n} in the prompt, {max_tokens} in the completion)")
    return max_tokens if max_tokens is not None else max_model_len - n


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab_size})")
