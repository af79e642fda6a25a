"""The served cluster on local Ray over real HTTP, with the official openai client."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from factories import tiny_spec
from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[str]:
    from pdserve.cluster import serve_app

    port = 18000 + os.getpid() % 1000
    cfg = serve_app.ServeConfig(model=str(model_dir), port=port, max_model_len=256,
                                engine_args={"num_kv_blocks": 256, "max_num_seqs": 64})
    ray.init(namespace=serve_app.NAMESPACE, num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve_app.run(cfg, block=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve_app.shutdown(cfg)
        ray.shutdown()


def test_colocated_cluster_serves_completions_like_the_offline_engine(cluster: str, model_dir: Path) -> None:
    c = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = ["def add(a, b):", "import sys\n", "class Foo:"]
    offline = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, exp in zip(prompts, expected):
        r = c.completions.create(model=os.path.basename(str(model_dir)), prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == exp.outputs[0].text
    stream = c.chat.completions.create(model=os.path.basename(str(model_dir)), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert len("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)) > 0
