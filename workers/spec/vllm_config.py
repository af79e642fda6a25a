"""vLLM's `speculative_config` (its `--speculative-config` JSON, `LLM(speculative_config={...})`) as
pdserve's engine settings.

Why: vLLM sets speculative decoding with one JSON object; pdserve with one setting a field
(`speculative`, `num_speculative_tokens`, `spec_ngram_min`, ...). A vLLM command line or script
that speculates should run as written, and one that asks for what pdserve cannot do (EAGLE, MTP,
a draft model with its own tensor parallelism) should say so, naming the key, not run without it.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.workers.inputs import json_object

# vLLM's key -> pdserve's setting, for the keys that carry over as they are
_SAME = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "spec_ngram_min",
         "prompt_lookup_max": "spec_ngram_max", "disable_by_batch_size": "spec_max_batch_size"}
_METHODS = {"ngram": "ngram", "draft_model": "draft"}  # vLLM's method -> pdserve's `speculative`
# vLLM's older spellings of ngram: a method, or a model that names the method (no draft directory)
_NGRAM = ("ngram", "[ngram]")


def speculative_settings(config: str | Mapping[str, object]) -> dict[str, object]:
    """The engine settings `config` (a JSON object's text, or the object) makes. ValueError, naming
    the key, for what pdserve does not do."""
    config = json_object(config, "speculative_config")
    settings: dict[str, object] = {}
    method, model = config.get("method"), config.get("model")
    if method is not None and not isinstance(method, str):  # (a list or an object: no dict key, a TypeError)
        raise ValueError(f"speculative_config: method must be a string, got {type(method).__name__}")
    if model in _NGRAM and method in (None, *_NGRAM):  # vLLM's rule: the model "[ngram]" is the method
        method, model = "ngram", None
    if method == "[ngram]":
        method = "ngram"
    if method is None:  # vLLM's rule: a draft model alone names the method
        method = "draft_model" if model is not None else None
    if method not in _METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not one pdserve runs (it runs "
                         f"{', '.join(repr(m) for m in _METHODS)})")
    settings["speculative"] = _METHODS[str(method)]
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config: model: the draft model's directory is required with method "
                             "'draft_model'")
        settings["draft_model"] = model
    elif model is not None:
        raise ValueError(f"speculative_config: model: method {method!r} takes no model")
    for key, value in config.items():
        if key in ("method", "model"):
            continue
        if key == "draft_tensor_parallel_size" and value in (None, 1):
            continue  # the draft runs beside the target's rank, as vLLM's default of 1
        if key not in _SAME:
            raise ValueError(f"speculative_config: {key} is not a key pdserve takes (it takes method, model, "
                             f"{', '.join(sorted(_SAME))})")
        if value is not None:  # null: vLLM's unset (its default; here pdserve's, or the other bound)
            settings[_SAME[key]] = value
    if method == "ngram":
        _one_bound_is_both(settings)
    return settings


def _one_bound_is_both(settings: dict[str, object]) -> None:
    """vLLM's rule: a prompt_lookup bound given alone is the other one too. Left to pdserve's
    defaults (1..4), `prompt_lookup_min` 5 alone was refused (min above the max) and
    `prompt_lookup_max` 2 alone matched suffixes vLLM never tries. (Neither given: pdserve's.)"""
    low, high = settings.get("spec_ngram_min"), settings.get("spec_ngram_max")
    if low is None and high is not None:
        settings["spec_ngram_min"] = high
    elif high is None and low is not None:
        settings["spec_ngram_max"] = low
