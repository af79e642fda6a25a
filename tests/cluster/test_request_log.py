"""vLLM's request log (--enable-log-requests, --enable-log-outputs, --max-log-len): what the
gateway was asked and what it answered, a line each, in the server's log; nothing by default."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from factories import tiny_engine_url, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.request_log import LOGGER
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec())


@pytest.fixture(scope="module")
def logged(model_dir: Path) -> Iterator[str]:
    with tiny_engine_url(model_dir, log_requests=True, log_outputs=True, max_log_len=6) as url:
        yield url


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_request_and_its_answer_are_logged_cut_to_max_log_len(logged: str, model_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    prompt_ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        r = requests.post(f"{logged}/v1/completions", json={"model": "tiny", "prompt": prompt_ids, "max_tokens": 9,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    received, generated = _lines(caplog)
    assert received.startswith(f"Received request {rid}: prompt: ")
    assert "prompt_token_ids: [5, 6, 7, 8, 9, 10]" in received and "max_tokens=9" in received
    # the oracle: the offline engine's greedy tokens for the same prompt
    llm = LLM(str(model_dir), max_model_len=1024, progress=False)
    want = llm.generate([prompt_ids], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))[0].outputs[0]
    assert generated.startswith(f"Generated response {rid}: output: {want.text[:6]!r}")
    assert f"output_token_ids: {list(want.token_ids[:6])}, finish_reason: length" in generated


def test_each_answer_of_a_request_with_several_is_logged_by_its_choice(
        logged: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        r = requests.post(f"{logged}/v1/completions", json={"model": "tiny", "prompt": [[5, 6], [7, 8]], "n": 2,
                                                         "max_tokens": 3, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    lines = _lines(caplog)
    assert sorted(line.split(":")[0].split(" ", 3)[-1] for line in lines if line.startswith("Received")) == \
        ["prompt 0", "prompt 1"]
    answers = sorted(line.split(":")[0].split(" ", 3)[-1] for line in lines if line.startswith("Generated"))
    assert answers == [f"choice {i}" for i in range(4)]


def test_nothing_is_logged_by_default(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tiny_engine_url(model_dir) as url, caplog.at_level(logging.INFO, logger=LOGGER):
        r = requests.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and _lines(caplog) == []


def test_echo_of_the_prompt_alone_logs_no_output(logged: str, caplog: pytest.LogCaptureFixture) -> None:
    """echo with max_tokens 0 answers the prompt alone: the one token the engine must sample is
    dropped (completion_tokens 0). Its line logged that token as the answer the client was sent."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        r = requests.post(f"{logged}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 0,
                                                         "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["choices"][0]["text"] == "hello"
    [generated] = [line for line in _lines(caplog) if line.startswith("Generated")]
    assert generated.endswith("output: '', output_token_ids: [], finish_reason: length"), generated
