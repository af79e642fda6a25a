"""What users coming from vLLM rely on: the model answers to the `--model` argument
as given (and its basename) or to `--served-model-name`, responses report the
first name, `vllm bench serve`'s requests work as it sends them, and
`LLM.generate` takes vLLM's prompt shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.serve_app import gateway_config
from pdserve.cluster.serve_config import ServeConfig, default_served_names
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.tiny.builder import TinyModelSpec

LEN = 256


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    """The offline engine: references, and LLM.generate's shapes (never the served engine:
    two threads must not step one engine)."""
    return LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=128, progress=False)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=128, progress=False).engine).start()
    yield engine
    engine.close()


def _app(engine: AsyncEngine, model_dir: Path, served_model_name: tuple[str, ...] | None = None) -> Any:
    """The gateway `pdserve serve --model <model_dir> [--served-model-name ...]` builds."""
    cfg = ServeConfig(EngineConfig(str(model_dir)), served_model_name=served_model_name)
    return build_app(Gateway(LocalBackend(engine), engine.engine.tokenizer, gateway_config(cfg, LEN, str(model_dir))))


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def test_default_names_are_the_argument_as_given_then_its_basename(model_dir: Path) -> None:
    assert default_served_names("/models/Qwen2-0.5B/") == ("/models/Qwen2-0.5B/", "Qwen2-0.5B")
    assert default_served_names("Qwen/Qwen2-0.5B") == ("Qwen/Qwen2-0.5B", "Qwen2-0.5B")
    assert default_served_names("tiny") == ("tiny",)
    assert ServeConfig(EngineConfig(str(model_dir))).served_names == (str(model_dir), model_dir.name)
    cfg = ServeConfig(EngineConfig(str(model_dir)), served_model_name=("a", "b", "a"))
    assert cfg.served_names == ("a", "b")  # repeats dropped, order kept
    assert ServeConfig(EngineConfig(str(model_dir)), served_model_name="a").served_names == ("a",)  # type: ignore[arg-type]
    for bad in ((), ("",), (" ",), (3,), 3):
        with pytest.raises(ValueError, match="^served_model_name"):
            ServeConfig(EngineConfig(str(model_dir)), served_model_name=bad)  # type: ignore[arg-type]


# -- vllm bench serve ----------------------------------------------------------------


def _bench_requests(model: str, prompt: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """(headers, body) of the /v1/completions requests `vllm bench serve` sends
    (backend vllm or openai), as its code builds them.

    vllm/benchmarks/lib/endpoint_request_func.py, `async_request_openai_completions`:
    model (--served-model-name, else --model as given), prompt, repetition_penalty
    1.0, max_tokens, logprobs (--logprobs, else null), stream, stream_options
    include_usage; ignore_eos only with --ignore-eos; then extra_body: the sampling
    flags given (--top-p, --top-k, --min-p, --temperature), temperature 0.0 when not
    (vllm/benchmarks/serve.py: greedy by default). Authorization only when
    OPENAI_API_KEY is set; an x-request-id header per request.
    The older benchmarks/backend_request_func.py: temperature 0.0 and best_of 1 in the
    body, and `Authorization: Bearer None` when OPENAI_API_KEY is unset."""
    common = {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None,
              "stream": True, "stream_options": {"include_usage": True}}
    return [
        ({"x-request-id": "benchmark-serving0"}, {**common, "ignore_eos": True, "temperature": 0.0}),
        ({"x-request-id": "benchmark-serving1"},  # --logprobs 1 --top-p 1 --top-k -1 --min-p 0, no --ignore-eos
         {**common, "logprobs": 1, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "temperature": 0.0}),
        ({"Authorization": "Bearer None"},
         {"model": model, "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": 12, "logprobs": None,
          "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ]


async def _read_like_vllm_bench(client: httpx.AsyncClient, headers: dict[str, str],
                                body: dict[str, Any]) -> tuple[str, int, set[str]]:
    """How the bench client reads the stream (its StreamedResponseHandler): SSE messages
    split at blank lines, `data:` lines, `[DONE]` skipped; the text of choices[0] of
    each chunk with choices, else usage.completion_tokens. Returns (text, completion
    tokens, the `model` of every chunk)."""
    text, tokens, models, buffer = "", 0, set(), ""
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for raw in r.aiter_bytes():
            buffer += raw.decode("utf-8")
            while "\n\n" in buffer:
                message, buffer = buffer.split("\n\n", 1)
                for line in message.strip().splitlines():
                    chunk = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    assert "error" not in data, data
                    models.add(data["model"])
                    if choices := data.get("choices"):
                        text += choices[0].get("text") or ""
                    elif usage := data.get("usage"):
                        tokens = usage.get("completion_tokens")
    assert not buffer.strip()
    return text, tokens, models


def test_vllm_bench_serve_requests_work_with_the_model_path_as_name(engine: AsyncEngine, model_dir: Path,
                                                                    llm: LLM) -> None:
    path, prompt = str(model_dir), "def fibonacci(n):"
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    to_length = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    want = [(to_length.text, 12), (greedy.text, len(greedy.token_ids)), (to_length.text, 12)]

    async def main() -> list[tuple[str, int, set[str]]]:
        async with _client(_app(engine, model_dir)) as c:
            # Its probe with no --model (vllm/benchmarks/serve.py, get_first_model_from_server):
            # data[0]'s id is the model it asks for, data[0]'s root the tokenizer it loads.
            listed = (await c.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [path, model_dir.name]
            assert listed[0]["root"] == path and listed[0]["object"] == "model"
            return [await _read_like_vllm_bench(c, h, b) for h, b in _bench_requests(path, prompt)]

    got = asyncio.run(main())
    assert [(text, tokens) for text, tokens, _ in got] == want
    assert all(models == {path} for _, _, models in got)  # the --model argument as given, in every chunk


# -- served names ------------------------------------------------------------------


def test_served_model_names_with_the_openai_client(engine: AsyncEngine, model_dir: Path) -> None:
    async def main() -> None:
        async with _client(_app(engine, model_dir, ("smol", "org/smol-v2"))) as http:
            client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http, max_retries=0)
            assert [m.id for m in (await client.models.list()).data] == ["smol", "org/smol-v2"]
            for name in ("smol", "org/smol-v2"):  # the first name in every response, whichever was asked for
                r = await client.completions.create(model=name, prompt="import os", max_tokens=4, temperature=0)
                assert r.model == "smol" and r.usage is not None and r.usage.completion_tokens == 4
                chat = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                            max_completion_tokens=2, temperature=0)
                assert chat.model == "smol"
                stream = await client.completions.create(model=name, prompt="import os", max_tokens=3, stream=True)
                assert {chunk.model async for chunk in stream} == {"smol"}
            # vLLM serves a request that names no model (or ""): the served one.
            for body in ({"prompt": "x", "max_tokens": 1}, {"model": "", "prompt": "x", "max_tokens": 1}):
                r2 = await http.post("/v1/completions", json=body)
                assert r2.status_code == 200 and r2.json()["model"] == "smol"

    asyncio.run(main())


def test_a_name_not_served_gets_openais_404(engine: AsyncEngine, model_dir: Path) -> None:
    async def main() -> None:
        # Names given: the model's path is no longer one of them (as in vLLM).
        async with _client(_app(engine, model_dir, ("smol",))) as http:
            client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http, max_retries=0)
            for unknown in (str(model_dir), "gpt-4o"):
                with pytest.raises(openai.NotFoundError) as e:
                    await client.completions.create(model=unknown, prompt="x", max_tokens=1)
                assert e.value.status_code == 404
                assert e.value.body == {"message": f"The model `{unknown}` does not exist.", "type": "NotFoundError",
                                        "param": "model", "code": 404}
            r = await http.post("/v1/chat/completions",
                                json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"

    asyncio.run(main())


# -- LLM.generate --------------------------------------------------------------------


def test_llm_generate_takes_vllms_prompt_shapes(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = "import os"
    ids = llm.tokenizer.encode(text)
    want = llm.generate([text], greedy)[0].outputs[0].token_ids
    shapes: list[Any] = [text, ids, {"prompt": text}, {"prompt_token_ids": ids},
                         {"prompt_token_ids": ids, "prompt": "ignored: the ids win, as in vLLM"},
                         [{"prompt": text}, {"prompt_token_ids": ids}, text, ids], ({"prompt": text},)]
    for shape in shapes:
        outs = llm.generate(shape, greedy)
        assert [o.outputs[0].token_ids for o in outs] == [want] * len(outs), shape
    assert llm.generate([], greedy) == []
    per_prompt = llm.generate([text, {"prompt": text}], [greedy, SamplingParams(temperature=0.0, max_tokens=2)])
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [6, 2]


@pytest.mark.parametrize("prompts, params, match", [
    ({"text": "x"}, None, "^prompts: .*does not support \\['text'\\]"),
    ({"prompt": "x", "multi_modal_data": {}}, None, "^prompts: .*does not support \\['multi_modal_data'\\]"),
    ({"prompt_token_ids": "1 2"}, None, "^prompts: prompt_token_ids must be a list"),
    ({"prompt": 3}, None, "^prompts: prompt must be a string"),
    ({}, None, "^prompts: a prompt is"),
    ([3.5], None, "^prompts: a prompt is"),
    (None, None, "^prompts: a prompt is"),
    (["x", {"prompt": None}], None, "^prompts: prompt must be"),  # the second of two: nothing runs
    (["x", "y"], [SamplingParams()], "^sampling_params: got 1 for 2 prompts"),
    ("x", {"temperature": 0.0}, "^sampling_params: a SamplingParams"),
])
def test_llm_generate_refuses_bad_shapes_naming_the_argument(llm: LLM, prompts: Any, params: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
