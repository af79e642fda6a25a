"""A model's sampling defaults (workers/generation_defaults.py): what its generation_config.json
sets fills the fields a request leaves unset, as vLLM's `--generation-config auto` (its default)
does; the request's own values win; `--generation-config vllm` ignores the file. The oracle for
"the model's defaults were used" is greedy output: top_k 1 makes sampling greedy."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from starlette.testclient import TestClient

from pdserve import LLM, SamplingParams
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers import generation_defaults
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

PROMPT = "The quick brown fox"
GREEDY_BY_DEFAULT = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 1, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its generation_config.json setting sampling defaults."""
    out = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(make_model(tiny_spec()), out)
    path = out / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**gen, **GREEDY_BY_DEFAULT}))
    return out


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[TestClient, LLM]]:
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=64, progress=False)
    engine = AsyncEngine(llm.engine).start()
    defaults = generation_defaults.read(model_dir)
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name="m", max_model_len=64, sampling_defaults=defaults))
    try:
        with TestClient(build_app(gw)) as client:
            yield client, llm
    finally:
        engine.close()


def test_the_files_sampling_fields_are_read_and_nothing_else(model_dir: Path, tmp_path: Path) -> None:
    assert generation_defaults.read(model_dir) == {"temperature": 0.7, "top_p": 0.8, "top_k": 1, "max_tokens": 5}
    assert generation_defaults.read(model_dir, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot", "top_p": None,
                                                                 "min_p": 0.05, "repetition_penalty": True}))
    assert generation_defaults.read(tmp_path) == {"min_p": 0.05}
    with pytest.raises(ValueError, match="generation_config"):
        generation_defaults.read(model_dir, "model")


def test_a_request_that_sets_no_sampling_field_samples_as_the_model_says(served: tuple[TestClient, LLM]) -> None:
    """Served without the model's defaults, such a request sampled at temperature 1 with no top-k
    (three seeds, three texts), where vLLM samples as the model's makers meant."""
    client, _ = served
    # Greedy through the server too: the LLM's engine is the AsyncEngine's, stepped by its thread.
    greedy = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
                         ).json()["choices"][0]["text"]
    texts = {client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": s}).json()
             ["choices"][0]["text"] for s in range(3)}
    assert texts == {greedy}
    # The request's own values win.
    own = {client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": s, "top_k": 0,
                                                "temperature": 1.0}).json()["choices"][0]["text"] for s in range(3)}
    assert len(own) > 1


def test_a_chat_without_max_tokens_stops_at_the_models_max_new_tokens(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 5
    assert client.post("/v1/chat/completions", json={**body, "max_tokens": 7}).json()["usage"][
        "completion_tokens"] == 7


def test_the_offline_engine_takes_the_models_defaults_when_given_none(model_dir: Path) -> None:
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=64, progress=False)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.7, 0.8, 1, 5)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    assert llm.generate(PROMPT)[0].outputs[0].token_ids == greedy


def test_a_served_gateway_reads_them_unless_told_vllm(model_dir: Path) -> None:
    from pdserve.cluster.serve_app import gateway_config
    from pdserve.cluster.serve_config import serve_config

    auto = serve_config({"model": str(model_dir)})
    vllm = serve_config({"model": str(model_dir), "generation_config": "vllm"})
    assert gateway_config(auto, 64, str(model_dir)).sampling_defaults["top_k"] == 1
    assert gateway_config(vllm, 64, str(model_dir)).sampling_defaults == {}


def test_vllms_override_generation_config_wins_over_the_models_file(model_dir: Path) -> None:
    """vLLM's --override-generation-config: its keys over the file's (with generation_config vllm,
    the only defaults); `pdserve serve` exited 2 on the flag."""
    from pdserve.cluster.serve_app import gateway_config
    from pdserve.cluster.serve_config import serve_config

    over = {"temperature": 0.1, "max_new_tokens": 9}
    auto = serve_config({"model": str(model_dir), "override_generation_config": json.dumps(over)})
    vllm = serve_config({"model": str(model_dir), "generation_config": "vllm", "override_generation_config": over})
    assert gateway_config(auto, 64, str(model_dir)).sampling_defaults == {
        "temperature": 0.1, "top_p": 0.8, "top_k": 1, "max_tokens": 9}
    assert gateway_config(vllm, 64, str(model_dir)).sampling_defaults == {"temperature": 0.1, "max_tokens": 9}


@pytest.mark.parametrize(("given", "named"), [
    ('{"temprature": 0.5}', "temprature"), ('{"temperature": -1}', "temperature"),
    ('{"top_p": "high"}', "top_p"), ('[0.5]', "JSON object"), ("{", "not a JSON object")])
def test_an_override_no_request_could_take_is_refused_at_start(given: str, named: str) -> None:
    from pdserve.cluster.serve_config import serve_config

    with pytest.raises(ValueError, match="override_generation_config") as e:
        serve_config({"model": "/m", "override_generation_config": given})
    assert named in str(e.value)
