"""Reasoning outputs (vLLM's --reasoning-parser): a thinking model's thinking split out of its
chat answers, whole and streamed, against vLLM's rules (docs "Reasoning Outputs";
vllm/reasoning/basic_parsers.py, deepseek_r1_reasoning_parser.py, qwen3_reasoning_parser.py)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, serve_gateway, sse_events, tiny_spec

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.reasoning import END, START, ReasoningPlan, ThinkingStream, closes_thinking
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

ASK = [{"role": "user", "content": "what time is it?"}]
THOUGHT = "<think>\nThe user wants the time.</think>\n\nIt is noon."
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'

# vLLM's extract_reasoning (basic_parsers.py, deepseek_r1's and qwen3's with thinking on):
# (model output, (reasoning, content))
WHOLE = [
    ("abc</think>def", ("abc", "def")),
    ("<think>abc</think>def", ("abc", "def")),
    ("\n<think>\nabc</think>\n\ndef", ("\nabc", "\n\ndef")),
    ("abc</think>", ("abc", None)),  # generation stopped right after the thinking: null content
    ("abc", ("abc", None)),  # no end tag: cut short, all thinking
    ("<think>abc", ("abc", None)),
    ("</think>def", ("", "def")),
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends the thinking
    ("", ("", None)),
]


@pytest.mark.parametrize(("text", "expected"), WHOLE, ids=[repr(t) for t, _ in WHOLE])
def test_a_whole_answer_splits_as_vllms_parsers_split_it(text: str, expected: tuple[str, str | None]) -> None:
    assert ReasoningPlan.split(text) == expected


@pytest.mark.parametrize("text", [t for t, _ in WHOLE] + [" <thin", "ab</thi", "ab</thx", "<thinx>a", "  a<think>b",
                                                     " \n", "<think></think>"])
def test_streamed_pieces_add_up_to_the_whole_split_for_every_chunking(text: str) -> None:
    """Cut into pieces of every size and place (up to 3 cuts), the thinking streamed adds up to the
    whole answer's, and the answer after it starts where the whole answer's content does."""
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(text)), k) for k in range(4)):
        stream, thinking, start = ThinkingStream(), "", None
        for end in [*cuts, len(text)]:
            piece, start = stream.advance(text[:end], end == len(text))
            thinking += piece
        assert (thinking, None if start is None else text[start:] or None) == ReasoningPlan.split(text), (text, cuts)


# -- served: a scripted model (its tokens given), the tiny model's tokenizer ------------------------


@pytest.fixture(scope="module")
def tokenizers(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[dict[str, Any]]:
    """The tiny model's tokenizer: "split" spells the tags in several tokens ('</', 'th', 'ink',
    '>'); "tags" has each tag one token (as DeepSeek-R1's and Qwen3's vocabularies have: added
    tokens that are not special, so their text stays in the output)."""
    from transformers import AutoTokenizer

    model = make_model(tiny_spec())
    tags = AutoTokenizer.from_pretrained(model)
    tags.add_tokens([START, END])
    yield {"split": AutoTokenizer.from_pretrained(model), "tags": tags}


class Scripted(FakeBackend):
    """Answers with `text`'s tokens, `per` a delta, each with a logprob entry (what the engine's
    detokenizer sends: a delta's text is its tokens' text)."""

    def __init__(self, tokenizer: Any, text: str, per: int = 1) -> None:
        self.ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(self.ids) == text
        self.tokenizer, self.per = tokenizer, per
        self.seen: list[SamplingParams] = []

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.seen.append(params)
        groups = [self.ids[i:i + self.per] for i in range(0, len(self.ids), self.per)]
        for k, group in enumerate(groups):
            last = k == len(groups) - 1
            entries = [{t: -0.5} for t in group] if params.logprobs is not None else None
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, self.tokenizer.decode(group), group, None, entries, "stop" if last else None)], last)


def answer(tokenizer: Any, text: str, body: dict[str, Any], parser: str | None = "deepseek_r1",
           per: int = 1, **config: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole response's choice and the streamed choices (chunks after the opening one)."""
    gw = Gateway(Scripted(tokenizer, text, per), tokenizer,
                 GatewayConfig(model_name="tiny", max_model_len=1024, reasoning_parser=parser,  # type: ignore[arg-type]
                               **config))
    req = {"model": "tiny", "messages": ASK, "max_tokens": 100, **body}
    with serve_gateway(gw) as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=req, timeout=60)
        streamed = httpx.post(f"{base}/v1/chat/completions", json={**req, "stream": True}, timeout=60)
    assert whole.status_code == 200 and streamed.status_code == 200, (whole.text, streamed.text)
    chunks = [c["choices"][0] for c in sse_events(streamed.text) if c["choices"]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""} and chunks[-1]["finish_reason"] is not None
    return whole.json()["choices"][0], chunks[1:]


def joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in chunks)


@pytest.mark.parametrize("vocab", ["split", "tags"])
@pytest.mark.parametrize("per", [1, 2])
def test_streamed_thinking_and_content_add_up_to_the_whole_answers(tokenizers: dict[str, Any], vocab: str,
                                                                    per: int) -> None:
    tok = tokenizers[vocab]
    whole, chunks = answer(tok, THOUGHT, {"logprobs": True}, per=per)
    message = whole["message"]
    assert (message["reasoning"], message["content"]) == ("\nThe user wants the time.", "\n\nIt is noon.")
    assert message["reasoning_content"] == message["reasoning"] and "tool_calls" not in message
    assert joined(chunks, "reasoning") == message["reasoning"] == joined(chunks, "reasoning_content")
    assert joined(chunks, "content") == message["content"]
    # The tags never reach the client; thinking comes before content.
    assert all(START not in (c["delta"].get(k) or "") and END not in (c["delta"].get(k) or "")
               for c in chunks for k in ("reasoning", "content"))
    kinds = [k for c in chunks for k in ("reasoning", "content") if c["delta"].get(k)]
    assert kinds == sorted(kinds, key=("reasoning", "content").index) and kinds.count("reasoning") > 2  # as it comes
    # Every token's logprob is sent, once, with the chunk that sends its text (a tag's, which is never
    # sent, with the next chunk).
    lps = [lp for c in chunks for lp in (c["logprobs"] or {"content": []})["content"]]
    assert [lp["token"] for lp in lps] == [lp["token"] for lp in whole["logprobs"]["content"]]
    assert "".join(lp["token"] for lp in lps) == THOUGHT
    for c in chunks:
        tokens = "".join(lp["token"] for lp in (c["logprobs"] or {"content": []})["content"])
        sent = (c["delta"].get("reasoning") or "") + (c["delta"].get("content") or "")
        assert tokens.replace(START, "").replace(END, "") == sent, c


def test_no_end_tag_is_all_thinking_cut_short(tokenizers: dict[str, Any]) -> None:
    """vLLM's deepseek_r1: the prompt opened the thinking (the template writes `<think>`), so all
    text before `</think>` is thinking; without one the answer was cut short."""
    whole, chunks = answer(tokenizers["split"], "Let me think about</th", {})
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("Let me think about</th", None)
    assert joined(chunks, "reasoning") == "Let me think about</th" and joined(chunks, "content") == ""


@pytest.mark.parametrize("vocab", ["split", "tags"])
def test_tool_calls_are_parsed_from_the_content_after_the_thinking(tokenizers: dict[str, Any], vocab: str) -> None:
    text = f"<think>I could answer {CALL} but let me just say it.</think>It is noon."
    whole, chunks = answer(tokenizers[vocab], text, {"tools": TOOLS})
    message = whole["message"]
    assert message["content"] == "It is noon." and not message.get("tool_calls")
    assert message["reasoning"] == f"I could answer {CALL} but let me just say it."
    assert not any(c["delta"].get("tool_calls") for c in chunks) and joined(chunks, "content") == "It is noon."
    assert joined(chunks, "reasoning") == message["reasoning"]

    text = f"<think>The user wants the time: get_time.</think>\n\n{CALL}"
    whole, chunks = answer(tokenizers[vocab], text, {"tools": TOOLS})
    message = whole["message"]
    assert message["reasoning"] == "The user wants the time: get_time." and whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"] and not message["content"]
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls") or []]
    assert [c["function"]["arguments"] for c in calls] == ['{"zone": "UTC"}']
    assert joined(chunks, "reasoning") == message["reasoning"] and joined(chunks, "content") == ""
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_include_reasoning_false_drops_the_thinking(tokenizers: dict[str, Any]) -> None:
    whole, chunks = answer(tokenizers["tags"], THOUGHT, {"include_reasoning": False, "logprobs": True})
    assert whole["message"]["content"] == "\n\nIt is noon."
    assert "reasoning" not in whole["message"] and "reasoning_content" not in whole["message"]
    assert not any("reasoning" in c["delta"] or "reasoning_content" in c["delta"] for c in chunks)
    assert joined(chunks, "content") == "\n\nIt is noon."
    lps = [lp["token"] for c in chunks for lp in (c["logprobs"] or {"content": []})["content"]]
    assert "".join(lps) == THOUGHT  # the thinking's tokens' logprobs still come (with the content)


@pytest.mark.parametrize("enable", [True, False])
def test_qwen3_without_thinking_is_all_content(tokenizers: dict[str, Any], enable: bool) -> None:
    """qwen3 with enable_thinking false: Qwen3's template closes the thinking in the prompt, so the
    answer is content (vLLM's qwen3 parser: no `</think>` and thinking off, all content)."""
    body = {"chat_template_kwargs": {"enable_thinking": enable}}
    whole, chunks = answer(tokenizers["tags"], "It is noon.", body, parser="qwen3")
    if enable:  # thinking on and no end tag: cut short, all thinking (vLLM's qwen3)
        assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("It is noon.", None)
        assert joined(chunks, "reasoning") == "It is noon."
    else:
        assert whole["message"]["content"] == "It is noon." and whole["message"].get("reasoning") is None
        assert joined(chunks, "content") == "It is noon." and joined(chunks, "reasoning") == ""
    whole, _ = answer(tokenizers["tags"], THOUGHT, {}, parser="qwen3")
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("\nThe user wants the time.",
                                                                            "\n\nIt is noon.")


# (rendered prompt, the assistant message it continues, whether the thinking is over before the answer)
PROMPTS = [
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None, True),  # Qwen3, enable_thinking false
    ("<|im_start|>assistant\n", None, False),  # Qwen3 thinking: the model opens it
    ("<｜Assistant｜><think>\n", None, False),  # DeepSeek-R1: the template opens it
    # an agent loop: an earlier turn's closed thinking stays in the prompt; the next answer thinks again
    ("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>{}</tool_call><|im_end|>\n"
     "<|im_start|>user\n<tool_response>1</tool_response><|im_end|>\n<|im_start|>assistant\n", None, False),
    ("<|im_start|>assistant\n<think>hm</think>It is", "<think>hm</think>It is", True),  # continued after it
    ("<|im_start|>assistant\n<think>hm", "<think>hm", False),  # continued inside it
    ("<|im_start|>assistant\nIt is", "It is", False),
    ("<｜Assistant｜><think>\nhm</think>It is", "hm</think>It is", True),  # R1: the template's <think>
]


@pytest.mark.parametrize(("prompt", "continued", "closed"), PROMPTS)
def test_the_prompts_end_says_whether_the_thinking_is_over(prompt: str, continued: str | None, closed: bool) -> None:
    assert closes_thinking(prompt, continued) is closed


CLOSING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|><think>\n\n</think>\n\n{% endif %}")


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "json_object"}}], ids=["free", "response_format"])
def test_a_template_that_closes_the_thinking_gets_content_and_its_grammar_from_the_first_token(
        tokenizers: dict[str, Any], body: dict[str, Any]) -> None:
    """A template other than Qwen3's (no enable_thinking here) that writes an empty thinking at the
    end of the prompt: the answer is content, and a grammar is not left waiting for a `</think>`
    the model will not write (it applied to nothing: the answer came out unconstrained)."""
    tok = copy.deepcopy(tokenizers["tags"])
    tok.chat_template = CLOSING_TEMPLATE
    text = '{"zone": "UTC"}'
    gw = Gateway(backend := Scripted(tok, text), tok, GatewayConfig(model_name="tiny", max_model_len=1024,
                                                                    reasoning_parser="deepseek_r1"))
    req = {"model": "tiny", "messages": ASK, "max_tokens": 100, **body}
    with serve_gateway(gw) as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=req, timeout=60).json()["choices"][0]["message"]
        chunks = [c["choices"][0] for c in sse_events(httpx.post(
            f"{base}/v1/chat/completions", json={**req, "stream": True}, timeout=60).text) if c["choices"]]
    assert whole["content"] == text and whole.get("reasoning") is None
    assert joined(chunks, "content") == text and joined(chunks, "reasoning") == ""
    if body:
        assert {p.constraint.after_token for p in backend.seen if p.constraint is not None} == {None}
    # The same tokenizer with the default template: the thinking is the model's to write, and to end.
    whole, _ = answer(tokenizers["tags"], text, {})
    assert whole["message"]["reasoning"] == text and whole["message"]["content"] is None


def test_a_continued_message_whose_thinking_is_closed_is_continued_as_content(tokenizers: dict[str, Any]) -> None:
    chat = [*ASK, {"role": "assistant", "content": "<think>Noon.</think>It is"}]
    body = {"messages": chat, "continue_final_message": True, "add_generation_prompt": False}
    whole, chunks = answer(tokenizers["tags"], " noon.", body)
    assert whole["message"]["content"] == " noon." and whole["message"].get("reasoning") is None
    assert joined(chunks, "content") == " noon."


def test_the_servers_default_template_kwargs_turn_thinking_off_unless_a_request_turns_it_on(
        tokenizers: dict[str, Any]) -> None:
    """vLLM's --default-chat-template-kwargs '{"enable_thinking": false}': every chat starts from
    them, so a Qwen3 answers without thinking (the parser takes the answer for content); a
    request's own chat_template_kwargs win."""
    off = {"default_template_kwargs": {"enable_thinking": False}}
    whole, _ = answer(tokenizers["tags"], "It is noon.", {}, parser="qwen3", **off)
    assert whole["message"]["content"] == "It is noon." and whole["message"].get("reasoning") is None
    body = {"chat_template_kwargs": {"enable_thinking": True}}
    whole, _ = answer(tokenizers["tags"], THOUGHT, body, parser="qwen3", **off)
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("\nThe user wants the time.",
                                                                            "\n\nIt is noon.")


def test_without_a_parser_the_thinking_stays_in_the_content(tokenizers: dict[str, Any]) -> None:
    whole, chunks = answer(tokenizers["tags"], THOUGHT, {}, parser=None)
    assert whole["message"] == {"role": "assistant", "content": THOUGHT}
    assert joined(chunks, "content") == THOUGHT and not any("reasoning" in c["delta"] for c in chunks)


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("body", [{"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": NAMED}],
                         ids=["response_format", "named-tool"])
def test_a_constrained_answer_thinks_first_where_the_thinking_ends_in_one_token(tokenizers: dict[str, Any],
                                                                                body: dict[str, Any]) -> None:
    """vLLM applies a request's grammar after the thinking. Where `</think>` is one token (DeepSeek-R1's,
    Qwen3's vocabularies), the worker is asked to start the grammar after it, and the answer splits
    as any other. Where the tag is several tokens, the grammar applies from the first token: the
    answer has no thinking, and is all content (docs/api.md)."""
    args = '{"zone": "UTC"}'
    for vocab in ("tags", "split"):
        tok = tokenizers[vocab]
        text = f"<think>Which zone?</think>{args}" if vocab == "tags" else args
        gw = Gateway(backend := Scripted(tok, text), tok, GatewayConfig(model_name="tiny", max_model_len=1024,
                                                                        reasoning_parser="deepseek_r1"))
        req = {"model": "tiny", "messages": ASK, "max_tokens": 100, **body}
        with serve_gateway(gw) as base:
            whole = httpx.post(f"{base}/v1/chat/completions", json=req, timeout=60).json()["choices"][0]["message"]
            streamed = [c["choices"][0]["delta"] for c in sse_events(httpx.post(
                f"{base}/v1/chat/completions", json={**req, "stream": True}, timeout=60).text) if c["choices"]]
        (after,) = {p.constraint.after_token for p in backend.seen if p.constraint is not None}
        assert after == (tok.convert_tokens_to_ids(END) if vocab == "tags" else None)
        got = whole["tool_calls"][0]["function"]["arguments"] if "tools" in body else whole["content"]
        assert got == args
        assert whole.get("reasoning") == ("Which zone?" if vocab == "tags" else None)
        assert "".join(d.get("reasoning") or "" for d in streamed) == (whole.get("reasoning") or "")


def test_completions_are_not_parsed(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["tags"]
    gw = Gateway(Scripted(tok, THOUGHT), tok, GatewayConfig(model_name="tiny", max_model_len=1024,
                                                            reasoning_parser="deepseek_r1"))
    with serve_gateway(gw) as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Q:", "max_tokens": 100}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == THOUGHT


LLAMA_CALL = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


@pytest.mark.parametrize("parser", [None, "hermes", "llama3_json"])
def test_the_tool_call_parser_flag_parses_its_format_only(tokenizers: dict[str, Any], parser: str | None) -> None:
    """vLLM's --tool-call-parser: "auto" answers are parsed for that one format. By default each
    format pdserve knows is tried, so a JSON answer naming a tool with its parameters is taken
    for a Llama 3 call even from a Hermes-format model; under `hermes` it is the answer's words,
    streamed as they come rather than held back as a call."""
    whole, chunks = answer(tokenizers["split"], LLAMA_CALL, {"tools": TOOLS}, parser=None, tool_call_parser=parser)
    if parser == "hermes":
        assert whole["message"]["content"] == LLAMA_CALL and not whole["message"].get("tool_calls")
        assert joined(chunks, "content") == LLAMA_CALL and sum(bool(c["delta"].get("content")) for c in chunks) > 3
    else:
        assert [c["function"]["arguments"] for c in whole["message"]["tool_calls"]] == ['{"zone": "UTC"}']
    whole, _ = answer(tokenizers["split"], CALL, {"tools": TOOLS}, parser=None, tool_call_parser=parser)
    assert bool(whole["message"].get("tool_calls")) == (parser != "llama3_json")


@pytest.mark.parametrize("vocab", ["split", "tags"])
@pytest.mark.parametrize(("text", "thinking_part"), [(THOUGHT, THOUGHT[:THOUGHT.index(END) + len(END)]),
                                                     ("Let me think about</th", "Let me think about</th"),
                                                     ("a</think>b</think>c", "a</think>")])
def test_usage_counts_the_reasoning_tokens_as_the_thinking_spans_them(tokenizers: dict[str, Any], vocab: str,
                                                                      text: str, thinking_part: str) -> None:
    """usage's reasoning tokens (chat's completion_tokens_details, Responses'
    output_tokens_details) are the answer's tokens through the end of its thinking, the end
    tag included; all of them when it never ended (cut short). The oracle: the thinking's own
    tokens, which begin the answer's."""
    tok = tokenizers[vocab]
    ids, want = tok.encode(text, add_special_tokens=False), tok.encode(thinking_part, add_special_tokens=False)
    assert ids[:len(want)] == want
    for per in (1, 3):  # a delta of several tokens may hold the end tag's last one anywhere
        gw = Gateway(Scripted(tok, text, per), tok, GatewayConfig(model_name="tiny", max_model_len=1024,
                                                                  reasoning_parser="deepseek_r1"))
        req = {"model": "tiny", "messages": ASK, "max_tokens": 100}
        with serve_gateway(gw) as base:
            whole = httpx.post(f"{base}/v1/chat/completions", json=req, timeout=60).json()["usage"]
            streamed = [c for c in sse_events(httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                **req, "stream": True, "stream_options": {"include_usage": True}}).text) if c.get("usage")]
            response = httpx.post(f"{base}/v1/responses", json={"input": "what time is it?"}, timeout=60).json()
        assert whole["completion_tokens"] == len(ids)
        assert whole["completion_tokens_details"] == {"reasoning_tokens": len(want)}, (vocab, per)
        assert streamed[-1]["usage"] == whole
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": len(want)}


def test_without_a_parser_no_reasoning_tokens_are_counted(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["tags"]
    gw = Gateway(Scripted(tok, THOUGHT), tok, GatewayConfig(model_name="tiny", max_model_len=1024))
    with serve_gateway(gw) as base:
        usage = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", "messages": ASK}, timeout=60).json()
        response = httpx.post(f"{base}/v1/responses", json={"input": "what time is it?"}, timeout=60).json()
    assert "completion_tokens_details" not in usage["usage"]
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
