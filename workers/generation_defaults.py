"""A model's own sampling defaults: what its generation_config.json sets for a request
that leaves a field unset (vLLM's `--generation-config auto`, its default since 0.8).

Instruct models ship them (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05): served without them, a request that names none samples at
temperature 1 with no top-k, where vLLM samples as the model's makers meant. A field
the request sets wins; what neither sets takes OpenAI's and vLLM's defaults.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from pdserve.workers.inputs import json_object
from pdserve.workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# generation_config.json's key -> the request field it fills (vLLM's list).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# What a field takes when neither the request nor the model sets it.
FALLBACK: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
SOURCES = ("auto", "vllm")  # --generation-config: the model's defaults, or vLLM's own only


def read(model_dir: str | Path, source: str = "auto") -> dict[str, float]:
    """The request fields the model's generation_config.json sets ({} with `source` "vllm",
    or without the file). Values that are not finite numbers are left out, with a warning."""
    if source not in SOURCES:
        raise ValueError(f"generation_config: must be one of {SOURCES}, got {source!r}")
    path = Path(model_dir) / "generation_config.json"
    if source == "vllm" or not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s: not read (%s); the sampling defaults are vLLM's", path, e)
        return {}
    out: dict[str, float] = {}
    for key, field in KEYS.items():
        value = gen.get(key) if isinstance(gen, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            log.warning("%s: %s=%r is no number; left out", path, key, value)
            continue
        out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    if out:
        log.info("sampling defaults from %s: %s (a request's own values win)", path, out)
    return out


def overrides(given: object) -> dict[str, float]:
    """vLLM's --override-generation-config (a JSON object's text, or the object): generation_config.json
    keys whose values win over the model's file (with `--generation-config vllm`, the only defaults),
    as request fields. ValueError naming a key that is none of KEYS or a value that is no finite number."""
    out: dict[str, float] = {}
    for key, value in json_object(given, "override_generation_config").items():
        if key not in KEYS:
            raise ValueError(f"override_generation_config: {str(key)[:40]!r} is not a key it takes "
                             f"({', '.join(KEYS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"override_generation_config: {key}: a finite number, got {value!r}"[:200])
        out[KEYS[key]] = int(value) if KEYS[key] in ("top_k", "max_tokens") else float(value)
    try:  # a value no request could take (a negative temperature) is refused at start, not per request
        SamplingParams(**out)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"override_generation_config: {e}") from None
    return out


def pick(field: str, given: float | None, defaults: dict[str, float]) -> float:
    """The value of sampling field `field`: the request's, else the model's, else the fallback."""
    if given is not None:
        return given
    return defaults.get(field, FALLBACK[field])


__all__ = ["FALLBACK", "KEYS", "SOURCES", "overrides", "pick", "read"]
