"""Hostile OpenAI requests, generated (hypothesis): every field of the completions, chat
and Responses schemas, each numeric one drawn from the extremes of what JSON can carry (0, -1,
the int32/int64/float64 edges, denormals, Infinity, NaN), the wrong type, or a sane
value, in any combination. Shared by tests/cluster/test_hostile_requests.py (a few
hundred, in-process) and bench/hostile_requests.py (10,000 against `pdserve serve`).

`judge` says what a server must answer each: 200 with a complete answer, or a 400 whose
OpenAI error object names a field the request sent. Anything else (a 5xx, a 400 that
names no field, a stream that breaks off) is a failure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

INT_EDGES = [0, 1, -1, 2, 3, 16, 2**31 - 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
             2**64, 2**64 - 1, 10**30, -(10**30)]
FLOAT_EDGES = [0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-6, 1e-5, 0.1, 0.5, 1.0, 1.5, 2.0, 2.0000001, 100.0, 100.5,
               1e5, 1e308, -1e308, -1.0, -2.0, -100.5, math.inf, -math.inf, math.nan]
WRONG_TYPES = [None, "1", "", True, [], {}, [1], {"a": 1}]
# Fields a refusal may name though the request did not send them: their defaults (max_tokens
# 16 with a long prompt is over the context) and the prompt the request's fields refer to.
IMPLIED = frozenset({"max_tokens", "prompt", "messages"})
# A Responses request's: its errors name its own fields, never chat's that it is served as.
IMPLIED_RESPONSES = frozenset({"input", "max_output_tokens"})


def _number() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(INT_EDGES), st.sampled_from(FLOAT_EDGES), st.integers(-5, 40),
                     st.floats(allow_nan=True, allow_infinity=True), st.integers())


def _field(sane: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly sane or an extreme number, sometimes the wrong type."""
    return st.one_of(sane, _number(), st.sampled_from(WRONG_TYPES))


_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
_TOKEN_IDS = st.lists(st.one_of(st.integers(0, 200), st.sampled_from(INT_EDGES)), min_size=0, max_size=8)

_SAMPLING = {
    "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0, 1)),
    "top_k": _field(st.sampled_from([-1, 0, 1, 5, 50])),
    "min_p": _field(st.floats(0, 1)),
    "seed": _field(st.integers(-(2**63), 2**63 - 1)),
    "n": _field(st.integers(1, 2)),
    "best_of": _field(st.integers(1, 2)),
    "min_tokens": _field(st.integers(0, 4)),
    "presence_penalty": _field(st.floats(-2, 2)),
    "frequency_penalty": _field(st.floats(-2, 2)),
    "repetition_penalty": _field(st.floats(0.5, 2)),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(0, 300).map(str), st.sampled_from(INT_EDGES).map(str),
                                                      st.sampled_from(["a", "-1", "1e3", " 5"])),
                                            _field(st.floats(-100, 100)), max_size=3),
                            st.sampled_from(WRONG_TYPES)),
    "stop": st.one_of(st.none(), _TEXT, st.lists(_TEXT, max_size=3), st.sampled_from(WRONG_TYPES)),
    "stop_token_ids": st.one_of(_TOKEN_IDS, st.sampled_from(WRONG_TYPES)),
    "ignore_eos": st.one_of(st.booleans(), st.sampled_from(WRONG_TYPES)),
    "stream": st.booleans(),
    "speculative": st.booleans(),
    "cache_salt": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES)),
    "prompt_logprobs": _field(st.integers(0, 3)),
}
# max_tokens kept small when sane (the run's length is what bounds a fuzzing run), extreme otherwise.
_MAX_TOKENS = _field(st.integers(1, 8))


def _optional(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def completion_bodies() -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.one_of(_TEXT.filter(bool), _TOKEN_IDS, st.lists(_TEXT, max_size=2), st.lists(_TOKEN_IDS, max_size=2),
                       st.sampled_from(WRONG_TYPES))
    fields = {**_SAMPLING, "max_tokens": _MAX_TOKENS, "logprobs": _field(st.integers(0, 5)),
              "echo": st.one_of(st.booleans(), st.sampled_from(WRONG_TYPES))}
    return st.builds(lambda p, rest: {"prompt": p, **rest}, prompt, _optional(fields))


def chat_bodies() -> st.SearchStrategy[dict[str, Any]]:
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                     "content": st.one_of(_TEXT, st.none(), st.sampled_from(WRONG_TYPES))})
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.sampled_from(WRONG_TYPES))
    fields = {**_SAMPLING, "max_tokens": _MAX_TOKENS, "max_completion_tokens": _MAX_TOKENS,
              "logprobs": st.one_of(st.booleans(), st.sampled_from(WRONG_TYPES)),
              "top_logprobs": _field(st.integers(0, 5))}
    return st.builds(lambda m, rest: {"messages": m, **rest}, messages, _optional(fields))


def _item() -> st.SearchStrategy[Any]:
    """One Responses input item: a message (its content text or parts), a function call or
    its output, or something that is none of them."""
    part = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image",
                                                                     "refusal"]),
                                            "text": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES))}),
                     st.sampled_from(WRONG_TYPES))
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant", "robot"]),
         "content": st.one_of(_TEXT, st.lists(part, max_size=2), st.sampled_from(WRONG_TYPES))},
        optional={"type": st.sampled_from(["message", "mesage"])})
    call = st.fixed_dictionaries({"type": st.just("function_call"),
                                  "call_id": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES)),
                                  "name": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES)),
                                  "arguments": st.one_of(st.just('{"a": 1}'), _TEXT, st.sampled_from(WRONG_TYPES))})
    output = st.fixed_dictionaries({"type": st.just("function_call_output"),
                                    "call_id": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES)),
                                    "output": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES))})
    return st.one_of(message, call, output, st.sampled_from(WRONG_TYPES))


def responses_bodies() -> st.SearchStrategy[dict[str, Any]]:
    inputs = st.one_of(_TEXT.filter(bool), st.lists(_item(), min_size=1, max_size=3), st.sampled_from(WRONG_TYPES))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                     {"type": "json_schema", "name": "a", "schema": schema},
                                     {"type": "json_schema"}, {"type": "yaml"}]),
                    st.sampled_from(WRONG_TYPES))
    tool = st.one_of(st.just({"type": "function", "name": "f", "parameters": schema}),
                     st.sampled_from([{"type": "web_search"}, {"type": "function"}, {"name": "f"}]),
                     st.sampled_from(WRONG_TYPES))
    sampling = {k: v for k, v in _SAMPLING.items() if k not in ("n", "best_of", "prompt_logprobs")}
    fields = {**sampling, "max_output_tokens": _MAX_TOKENS, "top_logprobs": _field(st.integers(0, 5)),
              "instructions": st.one_of(_TEXT, st.sampled_from(WRONG_TYPES)),
              "text": st.one_of(st.fixed_dictionaries({"format": fmt}), st.sampled_from(WRONG_TYPES)),
              "reasoning": st.one_of(st.fixed_dictionaries({"effort": st.sampled_from(["low", "high", 3, None])}),
                                     st.sampled_from(WRONG_TYPES)),
              "tools": st.one_of(st.lists(tool, max_size=2), st.sampled_from(WRONG_TYPES)),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                                       st.just({"type": "function", "name": "f"}), st.sampled_from(WRONG_TYPES)),
              "truncation": st.sampled_from(["auto", "disabled", "middle", 1]),
              "store": st.one_of(st.booleans(), st.sampled_from(WRONG_TYPES)),
              "previous_response_id": st.one_of(_TEXT, st.none()),
              "background": st.one_of(st.booleans(), st.sampled_from(WRONG_TYPES)),
              "metadata": st.one_of(st.dictionaries(_TEXT, _TEXT, max_size=2), st.sampled_from(WRONG_TYPES))}
    return st.builds(lambda i, rest: {"input": i, **rest}, inputs, _optional(fields))


def requests() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(route, body) pairs over the three generation routes."""
    return st.one_of(completion_bodies().map(lambda b: ("/v1/completions", b)),
                     chat_bodies().map(lambda b: ("/v1/chat/completions", b)),
                     responses_bodies().map(lambda b: ("/v1/responses", b)))


def encode(body: dict[str, Any]) -> bytes:
    """JSON as Python writes it: Infinity and NaN included (what a hostile client may send)."""
    return json.dumps(body, allow_nan=True).encode()


@dataclass
class Verdict:
    ok: bool
    kind: str  # "answered", "refused" or what went wrong
    detail: str = ""


def judge(body: dict[str, Any], status: int, text: str) -> Verdict:
    """What the server answered, against what it must answer (see the module's doc)."""
    if status == 400:
        try:
            err = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return Verdict(False, "400 without an OpenAI error object", text[:200])
        param = err.get("param")
        implied = IMPLIED_RESPONSES if "input" in body else IMPLIED
        if not param or param.split(".")[0].split("[")[0] not in body.keys() | implied:
            return Verdict(False, "400 that names no field the request sent", f"{param!r}: {err.get('message')}")
        return Verdict(True, "refused", param)
    if status != 200:
        return Verdict(False, f"HTTP {status}", text[:300])
    if "input" in body:
        return _judge_response(body, text)
    if body.get("stream") is True:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return Verdict(False, "a stream that did not end in [DONE]", text[-300:])
        if any('"error"' in e and json.loads(e).get("error") for e in events[:-1]):
            return Verdict(False, "a stream that ended in an error event", text[-300:])
        return Verdict(True, "answered")
    try:
        choices = json.loads(text)["choices"]
    except (ValueError, KeyError, TypeError):
        return Verdict(False, "a 200 without choices", text[:200])
    if not choices or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return Verdict(False, "a choice that did not finish", text[:300])
    return Verdict(True, "answered")


def _judge_response(body: dict[str, Any], text: str) -> Verdict:
    """A 200 to /v1/responses: a response that completed (or was cut by its length), whole
    or as a stream that ends in its terminal event (never [DONE], never an error event)."""
    try:
        if body.get("stream") is True:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
            if not events or events[-1].get("type") not in ("response.completed", "response.incomplete"):
                return Verdict(False, "a response stream that did not end in its terminal event", text[-300:])
            if any(e.get("type") == "error" for e in events):
                return Verdict(False, "a response stream with an error event", text[-300:])
            return Verdict(True, "answered")
        status = json.loads(text)["status"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return Verdict(False, "a 200 that is no response", text[:200])
    if status not in ("completed", "incomplete"):
        return Verdict(False, f"a response {status}", text[:300])
    return Verdict(True, "answered")
