"""Differential fuzz of the served text path: random greedy requests whose answers must agree.

1. Streamed vs not streamed: a choice's streamed deltas (text, or chat content) concatenate to
   the non-streamed text; finish_reason, stop_reason, usage and logprobs (tokens, values, top
   logprobs, text_offset) agree; every stream ends with `data: [DONE]`; choice indexes are right
   with n > 1 and batched prompts.
2. Served vs offline: the same request through `LLM.generate` / `LLM.chat` (pdserve's offline API)
   gives the same text and tokens.

Fields are drawn at random: stop strings cut from the request's own greedy output (spanning
tokens, at its very start, overlapping), include_stop_str_in_output, skip_special_tokens false,
echo (with and without logprobs, max_tokens 0), n, small max_tokens, min_tokens, ignore_eos,
stop_token_ids, continuous usage, chat with continue_final_message. Seeded and fixed in size;
PDSERVE_DIFF_CASES=N runs N cases (PDSERVE_DIFF_SEED picks the first) to hunt by hand.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import llama2_tokenizer, serve_gateway, tiny_spec

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway
from pdserve.cluster.serve_app import gateway_config
from pdserve.cluster.serve_config import ServeConfig
from pdserve.cluster.token_text import TokenText
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.detokenizer import _context
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec, init_model, save_model_dir

LEN = 96
CASES = int(os.environ.get("PDSERVE_DIFF_CASES", "50"))
FIRST_SEED = int(os.environ.get("PDSERVE_DIFF_SEED", "0"))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                          "parameters": {"type": "object", "properties": {
                                              "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
WORDS = ["def", " return", " self", "é", "日本", " 🙂", "\n", "import", " x", "_", "(", ")", ":", "ß", " data"]


@dataclass
class Served:
    """One gateway over an engine of the model, and an offline `LLM` of the same model (the oracle)."""

    url: str
    offline: LLM
    tokenizer: Any
    token_str: TokenText


SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def model_dir(request: pytest.FixtureRequest, make_model: Callable[[TinyModelSpec], Path],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (byte-level BPE: GPT-2, Llama 3, Qwen), and one over a Llama 2-style
    tokenizer (SentencePiece's "▁" and <0xNN> byte fallback, its decoder's leading space)."""
    if request.param == "byte_level":
        return make_model(SPEC)
    tok = llama2_tokenizer()
    out = tmp_path_factory.mktemp("llama2") / "m"
    save_model_dir(init_model(SPEC, tok), tok, out, False)
    return out


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    engine = AsyncEngine(LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=256, progress=False).engine).start()
    try:
        offline = LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=256, progress=False)
        cfg = ServeConfig(EngineConfig(str(model_dir)), served_model_name=("tiny",))
        gw = Gateway(LocalBackend(engine), engine.engine.tokenizer, gateway_config(cfg, LEN, str(model_dir)))
        with serve_gateway(gw) as base:
            yield Served(base + "/v1", offline, offline.tokenizer, TokenText(offline.tokenizer))
    finally:
        engine.close()


# -- drawing a request ----------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words)) or "x"


def _special_ids(tok: Any) -> list[int]:
    return sorted(set(tok.all_special_ids))


def _prompt_ids(rng: random.Random, tok: Any) -> list[int]:
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 10))]
    if rng.random() < 0.2:  # an id that splits a character: a byte-level vocabulary's single bytes
        ids.append(rng.randrange(0xA0, 0xC0))
    return ids


def _stops(rng: random.Random, text: str) -> list[str]:
    """Stop strings cut from `text` (the greedy output without them), so that they hit: a piece
    of it anywhere, its very start, overlapping pieces, a multi-byte character, one that never occurs."""
    if not text:
        return ["\u2603never"]
    out = []
    for _ in range(rng.randint(1, 3)):
        pick = rng.random()
        a = rng.randrange(len(text))
        if pick < 0.2:
            out.append(text[: rng.randint(1, min(3, len(text)))])
        elif pick < 0.4 and len(out) > 0:  # overlapping the one before
            prev = out[-1]
            at = text.find(prev)
            if at >= 0:
                b = max(0, at + len(prev) // 2)
                out.append(text[b : b + rng.randint(1, 4)] or prev)
                continue
            out.append(text[a : a + 2])
        elif pick < 0.5:
            wide = [c for c in text if ord(c) > 0x7F and c != "\ufffd"]  # (a character still cut is no text yet)
            out.append(rng.choice(wide) if wide else "\u2603never")
        elif pick < 0.55:
            out.append("\u2603never")
        else:
            out.append(text[a : a + rng.randint(1, 6)])
    return [s for s in out if s and "\ufffd" not in s] or ["\u2603never"]


def draw(rng: random.Random, sv: Served) -> tuple[str, dict[str, Any]]:
    """(path, body) of one random greedy request."""
    tok = sv.tokenizer
    chat = rng.random() < 0.35
    body: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": rng.choice([1, 2, 3, 5, 8, 12, 16])}
    if chat:
        path = "/chat/completions"
        messages: list[dict[str, str]] = [{"role": "user", "content": _text(rng, rng.randint(1, 6))}]
        if rng.random() < 0.3:
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(1, 4))})
            body.update(continue_final_message=True, add_generation_prompt=False)
        body["messages"] = messages
        if rng.random() < 0.4:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.35:
            body["tools"] = TOOLS
            body["tool_choice"] = rng.choice(["none", "auto", "auto", "auto", "required",
                                              {"type": "function", "function": {"name": "add"}}])
            if rng.random() < 0.3:
                body["parallel_tool_calls"] = False
            if body["tool_choice"] == "auto" and rng.random() < 0.5:  # an answer that may be a call
                marks = ["{", "<", "[", " {", "<tool_call>"]
                ids = [tok.encode(m, add_special_tokens=False)[0] for m in rng.sample(marks, 2)]
                body["logit_bias"] = {str(t): rng.choice([3.0, 6.0]) for t in ids}
    else:
        path = "/completions"
        as_ids = rng.random() < 0.7  # a batch is all token ids or all text (OpenAI's types)
        prompts: list[Any] = [_prompt_ids(rng, tok) if as_ids else _text(rng, rng.randint(1, 5))
                              for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        body["prompt"] = prompts[0] if len(prompts) == 1 and rng.random() < 0.5 else prompts
        if rng.random() < 0.25:
            body["echo"] = True
            if rng.random() < 0.4:
                body["max_tokens"] = 0
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["skip_special_tokens"] = False
    if rng.random() < 0.25 and body["max_tokens"] > 1:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
    if rng.random() < 0.3:
        body["include_stop_str_in_output"] = True
    if "logit_bias" not in body and rng.random() < 0.4:
        # toward special tokens and lone bytes: text that ends, or that cuts a character
        ids = [rng.choice(_special_ids(tok)) if rng.random() < 0.3 else rng.randrange(98, 261)
               for _ in range(rng.randint(1, 4))]
        body["logit_bias"] = {str(t): rng.choice([2.0, 4.0, 8.0]) for t in ids}
    return path, body


def add_stops(rng: random.Random, sv: Served, path: str, body: dict[str, Any]) -> None:
    """Stop strings and stop token ids drawn from the request's own output without them."""
    if body.get("max_tokens") == 0 or _forced_call(body) or rng.random() < 0.35:
        return
    first = offline(sv, path, {**body, "n": 1})[0]
    text, ids = first.text, first.token_ids
    if rng.random() < 0.75:
        stops = _stops(rng, text)
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.3 else stops
    if rng.random() < 0.3 and ids:
        body["stop_token_ids"] = rng.sample(ids, k=min(len(ids), rng.randint(1, 2)))


def _forced_call(body: dict[str, Any]) -> bool:
    """A grammar makes the answer a call ("required", a named function): no offline oracle."""
    return body.get("tool_choice") not in (None, "none", "auto")


# -- the offline oracle ---------------------------------------------------------------


def sampling(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    # "auto" tool calls keep special tokens' text (a marker may be one: docs/api.md)
    skip = body.get("skip_special_tokens", True) and body.get("tool_choice", "none") != "auto"
    return SamplingParams(
        n=body.get("n", 1), temperature=0.0, max_tokens=max_tokens, min_tokens=body.get("min_tokens", 0),
        stop=body.get("stop"), stop_token_ids=body.get("stop_token_ids"), ignore_eos=body.get("ignore_eos", False),
        skip_special_tokens=skip,
        include_stop_str_in_output=body.get("include_stop_str_in_output", False),
        logit_bias={int(t): b for t, b in body.get("logit_bias", {}).items()} or None)


@dataclass
class Expected:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_ids: list[int]


def offline(sv: Served, path: str, body: dict[str, Any]) -> list[Expected]:
    """Each choice as `LLM.generate` / `LLM.chat` makes it (echo's prompt text put before)."""
    max_tokens = body.get("max_tokens", 16)
    prompt_only = body.get("echo") and max_tokens == 0
    params = sampling(body, 1 if prompt_only else max_tokens)
    if path == "/chat/completions":
        outs = sv.offline.chat(body["messages"], params, add_generation_prompt=body.get("add_generation_prompt", True),
                               continue_final_message=body.get("continue_final_message", False),
                               tools=body.get("tools"))
        prompts: list[Any] = [None]
    else:
        p = body["prompt"]
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else p
        outs = sv.offline.generate([x if isinstance(x, str) else {"prompt_token_ids": x} for x in prompts], params)
    expected = []
    for prompt, out in zip(prompts, outs):
        echo = ""
        if body.get("echo"):
            echo = prompt if isinstance(prompt, str) else sv.tokenizer.decode(prompt)
        for c in out.outputs:
            if prompt_only:
                expected.append(Expected(echo, [], "length", None, out.prompt_token_ids))
            else:
                expected.append(Expected(echo + c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                         out.prompt_token_ids))
    return expected


# -- reading the answers ---------------------------------------------------------------


@dataclass
class Streamed:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finishes: int = 0  # chunks with a finish_reason (one)
    lp_tokens: list[Any] | None = None
    lp_values: list[Any] | None = None
    lp_top: list[Any] | None = None
    lp_offsets: list[int] | None = None
    content: list[Any] | None = None  # chat's logprobs.content
    calls: list[tuple[int, str, str]] | None = None  # chat's tool calls: (index, name, arguments)


def read_stream(raw: str, path: str) -> tuple[dict[int, Streamed], list[dict[str, Any]]]:
    lines = [ln for ln in raw.split("\n\n") if ln.strip()]
    assert lines and lines[-1] == "data: [DONE]", raw[-300:]
    assert lines.count("data: [DONE]") == 1
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all("error" not in e for e in events), events
    out: dict[int, Streamed] = {}
    for e in events:
        for ch in e["choices"]:
            s = out.setdefault(ch["index"], Streamed())
            assert s.finish_reason is None, f"choice {ch['index']} has a chunk after its finish: {ch}"
            if path == "/completions":
                s.text += ch["text"]
            else:
                delta = ch["delta"]
                s.text += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    fn = call["function"]
                    s.calls = (s.calls or []) + [(call["index"], fn["name"], fn["arguments"])]
            lp = ch.get("logprobs")
            if lp is not None:
                if path == "/completions":
                    s.lp_tokens = (s.lp_tokens or []) + lp["tokens"]
                    s.lp_values = (s.lp_values or []) + lp["token_logprobs"]
                    s.lp_top = (s.lp_top or []) + lp["top_logprobs"]
                    s.lp_offsets = (s.lp_offsets or []) + lp["text_offset"]
                else:
                    s.content = (s.content or []) + lp["content"]
            if ch.get("finish_reason") is not None:
                s.finish_reason, s.finishes = ch["finish_reason"], s.finishes + 1
                s.stop_reason = ch.get("stop_reason")
    return out, events


def _close(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-4 (the two runs batch differently); -inf as -inf."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) < 1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return bool(a == b)


def check_text_of_tokens(sv: Served, body: dict[str, Any], exp: Expected) -> None:
    """The text is what vLLM makes of the tokens: their decode after the prompt's last tokens (a
    SentencePiece word's leading space kept), cut at the first stop string to end after token
    `min_tokens` (the stop string kept with include_stop_str_in_output); a stop token's text left
    out unless include_stop_str_in_output, and no stop string looked for in it. Where a byte run
    decodes otherwise once a later byte comes (byte fallback), the text is not checked here."""
    if body.get("echo"):
        return
    skip = body.get("skip_special_tokens", True) and body.get("tool_choice", "none") != "auto"
    include = body.get("include_stop_str_in_output", False)
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    ids = list(exp.token_ids)
    by_token = exp.finish_reason == "stop" and not isinstance(exp.stop_reason, str)
    searched = len(ids) - 1 if by_token else len(ids)
    if by_token and not include:
        ids = ids[:-1]
    # The prompt's last tokens, as the detokenizer seeds its stream (tests/workers/test_text_edges.py)
    ctx = _context(sv.tokenizer.backend_tokenizer, exp.prompt_ids, skip)
    head = sv.tokenizer.decode(ctx, skip_special_tokens=skip)

    def text(k: int) -> str | None:
        whole = sv.tokenizer.decode(ctx + ids[:k], skip_special_tokens=skip)
        return whole[len(head):] if whole.startswith(head) else None

    texts = [text(k) for k in range(len(ids) + 1)]
    for a, b in zip(texts, texts[1:]):
        if a is None or b is None or not b.startswith(a.rstrip("\ufffd")):
            return
    want = texts[-1]
    for k in range(body.get("min_tokens", 0) + 1, searched + 1):  # the first token to complete a stop string
        upto = texts[k]
        assert upto is not None and texts[k - 1] is not None
        # (a character not yet whole is no text yet: DecodeStream holds its bytes back)
        before = len(texts[k - 1].rstrip("\ufffd"))
        hits = [(i + len(st), i, st) for st in stops if (i := upto.find(st, max(0, before - len(st) + 1))) >= 0]
        if hits:
            end, i, st = min(hits)
            want = upto[:end] if include else upto[:i]
            assert (exp.finish_reason, exp.stop_reason) == ("stop", st), (exp, st)
            break
    assert exp.text == want, (exp, want)


def check_case(sv: Served, path: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=sv.url, timeout=60) as c:
        whole_r = c.post(path, json=body)
        assert whole_r.status_code == 200, whole_r.text
        whole = whole_r.json()
        opts = {"include_usage": True, "continuous_usage_stats": bool(body.get("n", 1) % 2)}
        raw = c.post(path, json={**body, "stream": True, "stream_options": opts})
        assert raw.status_code == 200, raw.text
    streamed, events = read_stream(raw.text, path)
    choices = whole["choices"]
    assert [ch["index"] for ch in choices] == list(range(len(choices)))
    assert sorted(streamed) == list(range(len(choices))), (sorted(streamed), len(choices))
    expected = offline(sv, path, body)
    assert len(expected) == len(choices)
    for exp in expected:
        if not _forced_call(body):
            check_text_of_tokens(sv, body, exp)
    for ch, exp in zip(choices, expected):
        i = ch["index"]
        s = streamed[i]
        text = ch["text"] if path == "/completions" else ch["message"]["content"]
        calls = [(k, c["function"]["name"], c["function"]["arguments"])
                 for k, c in enumerate(ch["message"].get("tool_calls") or [])] if path != "/completions" else []
        # served vs offline
        if not calls and not _forced_call(body):
            assert text == exp.text, (i, text, exp.text)
            assert ch["finish_reason"] == exp.finish_reason, (i, ch, exp)
        assert ch["stop_reason"] == exp.stop_reason, (i, ch, exp)
        # streamed vs not
        assert (s.calls or []) == calls, (i, s.calls, calls)
        assert s.text == (text or ""), (i, s.text, text)
        assert s.finishes == 1
        assert (s.finish_reason, s.stop_reason) == (ch["finish_reason"], ch["stop_reason"]), (i, s, ch)
        lp = ch["logprobs"]
        if path == "/completions":
            if lp is None:
                assert s.lp_tokens is None
                continue
            assert s.lp_tokens == lp["tokens"], (i, s.lp_tokens, lp["tokens"])
            assert _close(s.lp_values, lp["token_logprobs"]), (i, s.lp_values, lp["token_logprobs"])
            assert _close(s.lp_top, lp["top_logprobs"]), (i, s.lp_top, lp["top_logprobs"])
            assert s.lp_offsets == lp["text_offset"], (i, s.lp_offsets, lp["text_offset"])
            generated = lp["tokens"][len(lp["tokens"]) - len(exp.token_ids):] if exp.token_ids else []
            assert generated == [sv.token_str(t) for t in exp.token_ids], (i, lp["tokens"], exp.token_ids)
            if not body.get("echo"):
                assert len(lp["tokens"]) == len(exp.token_ids), (i, lp["tokens"], exp.token_ids)
        else:
            if lp is None:
                assert s.content is None
                continue
            assert _close(s.content or [], lp["content"]), (i, s.content, lp["content"])
            assert _forced_call(body) or len(lp["content"]) == len(exp.token_ids), (i, lp["content"], exp.token_ids)
    # usage: the last chunk's, and (continuous) every chunk's so far
    usage = whole["usage"]
    last = events[-1]
    assert last["choices"] == [] and "usage" in last, last
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert last["usage"][key] == usage[key], (key, last["usage"], usage)
    if not body.get("echo") and not _forced_call(body):
        assert usage["completion_tokens"] == sum(len(e.token_ids) for e in expected), (usage, expected)
    if opts["continuous_usage_stats"]:
        seen = [e["usage"]["completion_tokens"] for e in events]
        assert seen == sorted(seen) and seen[-1] == usage["completion_tokens"], seen


def run_cases(sv: Served, first: int, count: int) -> None:
    """Every case, then every mismatch (its seed and request first: the case to replay)."""
    failed = []
    for seed in range(first, first + count):
        rng = random.Random(seed)
        path, body = draw(rng, sv)
        add_stops(rng, sv, path, body)
        try:
            check_case(sv, path, body)
        except AssertionError as e:
            failed.append(f"seed {seed}: {path} {json.dumps(body, ensure_ascii=False)}\n{str(e)[:1500]}")
    assert not failed, f"{len(failed)} of {count} cases:\n\n" + "\n\n".join(failed)


def test_streamed_served_and_offline_answers_agree(served: Served) -> None:
    run_cases(served, FIRST_SEED, CASES)
