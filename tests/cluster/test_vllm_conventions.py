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
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.serve_config import ServeConfig, default_served_names
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=128, progress=False)


@pytest.fixture
def gateway(model_dir: Path, llm: LLM) -> Iterator[tuple[Gateway, str]]:
    names = ServeConfig(EngineConfig(str(model_dir))).served_names
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name=names[0], aliases=names[1:], max_model_len=256))
    yield gw, str(model_dir)
    engine.close()


def test_default_names_are_the_argument_as_given_then_its_basename(model_dir: Path) -> None:
    assert default_served_names("/models/Qwen2-0.5B/") == ("/models/Qwen2-0.5B/", "Qwen2-0.5B")
    assert default_served_names("Qwen/Qwen2-0.5B") == ("Qwen/Qwen2-0.5B", "Qwen2-0.5B")
    assert default_served_names("tiny") == ("tiny",)
    cfg = ServeConfig(EngineConfig(str(model_dir)), served_model_name=("a", "b", "a"))
    assert cfg.served_names == ("a", "b")  # repeats dropped, order kept
    for bad in ((), ("",), (" ",), (3,)):
        with pytest.raises(ValueError, match="^served_model_name"):
            ServeConfig(EngineConfig(str(model_dir)), served_model_name=bad)  # type: ignore[arg-type]


def _bench_payloads(model: str, prompt: str) -> list[dict[str, Any]]:
    """The /v1/completions bodies `vllm bench serve` sends (backend vllm/openai):
    vllm/benchmarks/lib/endpoint_request_func.py (its sampling parameters come as
    extra_body: temperature 0.0 unless --temperature is given, i.e. greedy), and the
    older benchmarks/backend_request_func.py (temperature and best_of in the body)."""
    new = {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None,
           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    old = {"model": model, "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": 12, "logprobs": None,
           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    return [new, old]


async def _read_like_vllm_bench(client: httpx.AsyncClient, payload: dict[str, Any]) -> tuple[str, int, str]:
    """How the bench client reads the stream: text of choices[0] per chunk, then usage."""
    text, tokens, model = "", 0, ""
    headers = {"Authorization": "Bearer None"}  # OPENAI_API_KEY unset: the client still sends the header
    async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            chunk = line.removeprefix("data: ").strip()
            if not chunk or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            assert "error" not in data, data
            model = data["model"]
            if choices := data.get("choices"):
                text += choices[0].get("text") or ""
            elif usage := data.get("usage"):
                tokens = usage["completion_tokens"]
    return text, tokens, model


def test_vllm_bench_serve_requests_work_with_the_model_path_as_name(gateway: tuple[Gateway, str], llm: LLM) -> None:
    gw, model_path = gateway
    prompt = "def fibonacci(n):"
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text

    async def main() -> list[tuple[str, int, str]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            listed = (await c.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [model_path, Path(model_path).name]
            return [await _read_like_vllm_bench(c, p) for p in _bench_payloads(model_path, prompt)]

    for text, tokens, model in asyncio.run(main()):
        assert (text, tokens, model) == (want, 12, model_path)


def test_served_model_names_with_the_openai_client(model_dir: Path, llm: LLM) -> None:
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name="smol", aliases=("org/smol-v2",), max_model_len=256))
    http = httpx.Client(transport=_SyncASGI(build_app(gw)), base_url="http://gw/v1")
    client = openai.OpenAI(base_url="http://gw/v1", api_key="none", http_client=http, max_retries=0)
    try:
        assert [m.id for m in client.models.list().data] == ["smol", "org/smol-v2"]
        for name in ("smol", "org/smol-v2"):
            r = client.completions.create(model=name, prompt="import os", max_tokens=4, temperature=0)
            assert r.model == "smol" and r.usage.completion_tokens == 4  # the first name, whichever was asked
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=str(model_dir), prompt="x", max_tokens=1)
        assert e.value.status_code == 404 and e.value.body["code"] == 404  # type: ignore[index]
        assert "does not exist" in e.value.body["message"]  # type: ignore[index]
    finally:
        http.close()
        engine.close()


class _SyncASGI(httpx.BaseTransport):
    """The openai client is synchronous here: run the ASGI app on an event loop of our own."""

    def __init__(self, app: Any) -> None:
        self._inner = httpx.ASGITransport(app=app)
        self._loop = asyncio.new_event_loop()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def go() -> httpx.Response:
            r = await self._inner.handle_async_request(request)
            body = b"".join([part async for part in r.stream])  # type: ignore[union-attr]
            return httpx.Response(r.status_code, headers=r.headers, content=body, request=request)

        return self._loop.run_until_complete(go())

    def close(self) -> None:
        self._loop.close()


def test_llm_generate_takes_vllms_prompt_shapes(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = "import os"
    ids = llm.tokenizer.encode(text)
    want = llm.generate([text], greedy)[0].outputs[0].token_ids
    shapes: list[Any] = [text, ids, {"prompt": text}, {"prompt_token_ids": ids},
                         [{"prompt": text}, {"prompt_token_ids": ids}, text, ids]]
    for shape in shapes:
        outs = llm.generate(shape, greedy)
        assert [o.outputs[0].token_ids for o in outs] == [want] * len(outs), shape
    per_prompt = llm.generate([text, {"prompt": text}], [greedy, SamplingParams(temperature=0.0, max_tokens=2)])
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [6, 2]
    for bad, match in (({"prompt": text, "prompt_token_ids": ids}, "exactly one of"),
                       ({"text": text}, "exactly one of"), ({"prompt_token_ids": "1 2"}, "prompt_token_ids must be"),
                       ([3.5], "a prompt is"), (None, "a prompt is")):
        with pytest.raises(ValueError, match=f"^prompts: .*{match}"):
            llm.generate(bad, greedy)
