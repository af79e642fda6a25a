"""vLLM's /tokenize and /detokenize (cluster/tokenize_routes.py): the served model's own
tokenizer over HTTP. The oracle is transformers' tokenizer loaded apart from the server's;
the count a client gets is the prompt_tokens the server then charges for the same prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

LEN = 64
TEXT = "The quick brown fox jumps over the lazy dog, twice."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def served(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[tuple[TestClient, Any]]:
    model_dir = make_model(tiny_spec())
    llm = LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=64, progress=False)
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name="tiny", max_model_len=LEN, max_in_flight=16, request_timeout_s=30))
    try:
        with TestClient(build_app(gw)) as client:
            yield client, AutoTokenizer.from_pretrained(model_dir)
    finally:
        engine.close()


def test_a_text_is_tokenized_as_transformers_does(served: tuple[TestClient, Any]) -> None:
    client, oracle = served
    body = client.post("/tokenize", json={"model": "tiny", "prompt": TEXT, "return_token_strs": True}).json()
    want = oracle.encode(TEXT)
    assert body == {"count": len(want), "max_model_len": LEN, "tokens": want,
                    "token_strs": oracle.convert_ids_to_tokens(want)}
    plain = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == oracle.encode(TEXT, add_special_tokens=False) and plain["token_strs"] is None
    # Longer than the context: counted all the same (what a client asks before it trims).
    long = client.post("/tokenize", json={"prompt": TEXT * 20}).json()
    assert long["count"] == len(oracle.encode(TEXT * 20)) > LEN


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chat_is_tokenized_through_the_models_template(served: tuple[TestClient, Any],
                                                         add_generation_prompt: bool) -> None:
    client, oracle = served
    body = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": add_generation_prompt}).json()
    want = oracle.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                      add_generation_prompt=add_generation_prompt)
    assert body["tokens"] == list(want) and body["count"] == len(want)


def test_the_count_is_what_a_completion_of_the_same_prompt_is_charged(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    short = TEXT[:30]
    count = client.post("/tokenize", json={"prompt": short}).json()["count"]
    usage = client.post("/v1/completions", json={"prompt": short, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == count
    count = client.post("/tokenize", json={"messages": CHAT}).json()["count"]
    usage = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == count


CONTINUED = [*CHAT, {"role": "assistant", "content": "The fox is"}]


def test_a_final_assistant_message_is_continued_as_vllm_does(served: tuple[TestClient, Any]) -> None:
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside
    the assistant's message, for the model to go on with it; on /tokenize and in a chat."""
    client, oracle = served
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    want = list(oracle.apply_chat_template(CONTINUED, tokenize=True, return_dict=False, **flags))
    assert oracle.decode(want).endswith("The fox is")
    body = client.post("/tokenize", json={"messages": CONTINUED, **flags}).json()
    assert body["tokens"] == want
    usage = client.post("/v1/chat/completions", json={"messages": CONTINUED, "max_tokens": 1, **flags}).json()["usage"]
    assert usage["prompt_tokens"] == len(want)
    for path in ("/tokenize", "/v1/chat/completions"):
        both = client.post(path, json={"messages": CONTINUED, "continue_final_message": True})
        user_last = client.post(path, json={"messages": CHAT, **flags})
        for r in (both, user_last):
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_a_model_without_a_chat_template_answers_chat_with_a_400(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A base model: transformers raises a plain ValueError, which was a 500 ("internal error")."""
    from factories import FakeBackend

    tokenizer = AutoTokenizer.from_pretrained(make_model(tiny_spec()))
    tokenizer.chat_template = None
    gw = Gateway(FakeBackend(), tokenizer, GatewayConfig(model_name="tiny", max_model_len=LEN))
    with TestClient(build_app(gw)) as client:
        for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                           ("/tokenize", {"messages": CHAT})):
            r = client.post(path, json=body)
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"], r.text


def test_special_tokens_in_the_output_when_asked(served: tuple[TestClient, Any]) -> None:
    """vLLM's skip_special_tokens (true by default): false keeps their text in the output."""
    client, oracle = served
    eos = oracle.eos_token_id
    body = {"prompt": TEXT[:20], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos): 100}}
    skipped = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    kept = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert skipped == "" and kept == oracle.decode([eos, eos])


def test_detokenize_gives_back_the_text(served: tuple[TestClient, Any]) -> None:
    client, oracle = served
    ids = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"model": "tiny", "tokens": ids}).json() == {"prompt": TEXT}
    with_bos = oracle.encode(TEXT)
    assert client.post("/detokenize", json={"tokens": with_bos}).json()["prompt"] == oracle.decode(with_bos)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", '{"prompt": "a lone \\ud800"}', 400, "prompt"),  # JSON may carry it; UTF-8 cannot
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True, 1.0]}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
])
def test_bad_input_is_a_clear_error_naming_the_field(served: tuple[TestClient, Any], path: str,
                                                      body: dict[str, Any] | str, status: int, param: str) -> None:
    client, _ = served
    r = (client.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, str)
         else client.post(path, json=body))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    assert client.post("/tokenize", json={"prompt": "still here"}).status_code == 200


def test_a_lone_surrogate_the_template_renders_from_any_field_is_a_400() -> None:
    """Tools, names and tool-call arguments reach the rendered text unchecked by the content
    check; the tokenizer would raise on it (a 500). The rendered text is checked whole."""
    from pdserve.cluster.api_errors import APIError
    from pdserve.cluster.protocol import ChatMessage

    class Template:
        chat_template = "a template"

        def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
            return "".join(f"<{m['role']}:{m.get('name', '')}>{m['content']}" for m in messages)

    gw = Gateway.__new__(Gateway)
    gw.tokenizer, gw.config = Template(), GatewayConfig(model_name="t", max_model_len=LEN)
    assert gw.chat_text([ChatMessage(role="user", content="hi", name="ann")], None) == "<user:ann>hi"
    with pytest.raises(APIError) as e:
        gw.chat_text([ChatMessage(role="user", content="hi", name="\udc00")], None)
    assert e.value.status == 400 and e.value.param == "messages"


def test_a_text_beyond_four_contexts_is_refused_before_tokenizing(served: tuple[TestClient, Any]) -> None:
    """Longer than the context is counted, but not without end: a 4 MB text held the tokenizer
    pool's long lane ~10 s (the prompts behind it waited) for a 20 MB answer. Past four
    contexts' worth of characters (the prompt bound's measure) it is a 400 naming the field,
    at once, and the next request is served."""
    from pdserve.cluster.prompt_bound import char_bound
    from pdserve.cluster.tokenize_routes import CONTEXTS_COUNTED, MAX_TOKENIZE_CHARS

    client, oracle = served
    bound = char_bound(oracle, LEN)
    assert bound is not None
    most = min(MAX_TOKENIZE_CHARS, CONTEXTS_COUNTED * bound.max_chars)
    r = client.post("/tokenize", json={"prompt": "a" * (most + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"at most {most} characters to tokenize" in r.json()["error"]["message"]
    assert client.post("/tokenize", json={"prompt": "ab " * (most // 3)}).status_code == 200
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a" * 4_000_000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # Empty messages have no text, but the template renders each (as the chat route counts them):
    # a body of them all was rendered, however many.
    from pdserve.cluster.gateway import TEMPLATE_CHARS_PER_MESSAGE

    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": ""}] *
                                       (most // TEMPLATE_CHARS_PER_MESSAGE + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert client.post("/tokenize", json={"prompt": TEXT}).status_code == 200


def test_detokenize_takes_up_to_four_contexts_of_ids(served: tuple[TestClient, Any]) -> None:
    """As /tokenize's texts: a body of ids (8 M of them fit the 16 MiB body limit) was checked
    on the event loop (~0.5 s), decoded in the long lane (~4.5 s) and answered with ~37 MB,
    where /v1/completions refuses a prompt of the same ids at once. Four contexts' worth is
    decoded (a completion's ids always fit); past it a 400 naming `tokens`, at once."""
    from pdserve.cluster.tokenize_routes import CONTEXTS_COUNTED

    client, oracle = served
    ids = oracle.encode(TEXT, add_special_tokens=False)
    most = CONTEXTS_COUNTED * LEN
    fits = (ids * most)[:most]
    assert client.post("/detokenize", json={"tokens": fits}).json() == {"prompt": oracle.decode(fits)}
    r = client.post("/detokenize", json={"tokens": [*fits, ids[0]]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tokens" and f"at most {most} token ids" in error["message"], error


def _serve_gateway_app(monkeypatch: pytest.MonkeyPatch, model: Path, **settings: Any) -> Any:
    """What `build_gateway_app` builds for a colocated config of `model` (no Ray: no worker
    answers, a fake backend), with `settings` (the engine's `tokenizer`, or serve settings)."""
    import types

    from factories import FakeBackend

    import pdserve.cluster.backend as backend_module
    from pdserve.cluster import serve_app
    from pdserve.cluster.serve_config import ServeConfig, ServingMode
    from pdserve.workers.config import EngineConfig

    monkeypatch.setattr(serve_app, "_any_worker_info", lambda cfg, timeout_s=120.0: types.SimpleNamespace(
        max_model_len=LEN))
    monkeypatch.setattr(serve_app, "find_worker", lambda name: None)
    monkeypatch.setattr(backend_module, "ColocatedBackend", lambda *a, **k: FakeBackend())
    engine = EngineConfig(model=str(model), tokenizer=settings.pop("tokenizer", None))
    return serve_app.build_gateway_app(ServeConfig(engine, mode=ServingMode.COLOCATED, num_colocated=1, **settings))


def _post(app: Any, path: str, body: dict[str, Any]) -> Any:
    import asyncio

    import httpx

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post(path, json=body)

    return asyncio.run(post())


def test_the_gateway_tokenizes_with_the_tokenizer_flag(make_model: Callable[[TinyModelSpec], Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve serve --tokenizer DIR`: the workers decode with DIR's tokenizer; the gateway
    loaded the model directory's, so a model directory with no tokenizer (the usual reason for
    the flag) could not start its gateway, and two different ones would not agree."""
    import shutil

    model_dir = make_model(tiny_spec())
    weights = tmp_path / "weights"
    shutil.copytree(model_dir, weights)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (weights / f).unlink()
    app = _serve_gateway_app(monkeypatch, weights, tokenizer=str(model_dir))
    assert _post(app, "/tokenize", {"prompt": TEXT}).json()["tokens"] == AutoTokenizer.from_pretrained(
        model_dir).encode(TEXT)


def test_the_chat_template_flag_renders_every_chat(make_model: Callable[[TinyModelSpec], Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `--chat-template FILE` (or the template itself): a base model, whose tokenizer has
    no template, answered every chat with a 400, and a model with a wrong template could not be
    given a right one. The gateway renders chats (and /tokenize's) with it; the file is read
    where the settings are made, and a broken template is refused there, by name."""
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.config import EngineConfig

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    oracle = AutoTokenizer.from_pretrained(make_model(tiny_spec()))
    want = oracle.encode("[system] Be brief.\n[user] Name a fox.\n[assistant]", add_special_tokens=False)
    for given in (str(path), template):
        app = _serve_gateway_app(monkeypatch, make_model(tiny_spec()), chat_template=given)
        assert _post(app, "/tokenize", {"messages": CHAT}).json()["tokens"] == want
    for bad, why in ((str(tmp_path / "missing.jinja"), "not a file"), ("{% for m in messages %}", "line 1")):
        with pytest.raises(ValueError, match=f"^chat_template: .*{why}"):
            ServeConfig(EngineConfig(model="/m"), chat_template=bad)
