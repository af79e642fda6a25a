"""What `LLM.chat` and `LLM.generate` take offline, checked (workers/chat_input.py): a caller's
mistake is a ValueError naming the argument, not jinja's UndefinedError, a TypeError from the
renderer or the tokenizer, and the engine serves on. Each case was found by fuzzing the API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(make_model: Callable[[TinyModelSpec], Path]) -> LLM:
    return LLM(str(make_model(tiny_spec())), max_model_len=256, num_kv_blocks=64, enforce_eager=True, progress=False)


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "no-role": ({"messages": [{"content": "hi"}]}, r"messages\[0\]\.role: "),
    "role-not-str": ({"messages": [{"role": 5, "content": "hi"}]}, r"messages\[0\]\.role: "),
    "content-int": ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content: "),
    "image-part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                   r"messages\[0\]\.content\[0\]: text content parts only"),
    "part-text-int": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                      r"messages\[0\]\.content\[0\]\.text: "),
    "surrogate": ({"messages": [{"role": "user", "content": "\ud800"}]}, r"messages\[0\]\.content: not valid Unicode"),
    "empty": ({"messages": []}, "messages: a non-empty list"),
    "empty-conversation": ({"messages": [HI, []]}, r"messages\[1\]: a conversation is a non-empty list"),
    "tools-str": ({"messages": HI, "tools": "x"}, "tools: "),
    "tools-not-function": ({"messages": HI, "tools": [{"foo": 1}]}, r"tools\[0\]: "),
    "kwargs-str": ({"messages": HI, "chat_template_kwargs": "x"}, "chat_template_kwargs: "),
    "kwargs-int-key": ({"messages": HI, "chat_template_kwargs": {1: 2}}, "chat_template_kwargs: "),
    "template-int": ({"messages": HI, "chat_template": 5}, "chat_template: "),
    "template-broken": ({"messages": HI, "chat_template": "{% for %}"}, "chat_template: not a valid template"),
    "template-raises": ({"messages": HI, "chat_template": "{{ raise_exception('no system role') }}"},
                        "messages: the chat template refused them: no system role"),
    "generation-prompt-str": ({"messages": HI, "add_generation_prompt": "no"}, "add_generation_prompt: "),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_chat_argument_is_a_value_error_naming_it(llm: LLM, case: str) -> None:
    kwargs, match = BAD[case]
    with pytest.raises(ValueError, match=f"^{match}"):
        llm.chat(sampling_params=PARAMS, **kwargs)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0


def test_text_parts_are_the_text_they_join_as_vllm_reads_them(llm: LLM) -> None:
    """OpenAI's content parts, which vLLM's LLM.chat takes: a TypeError inside the template."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "hi\nthere"}]
    got, want = llm.chat(parts, PARAMS)[0], llm.chat(plain, PARAMS)[0]
    assert got.prompt == want.prompt and got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_prompt_that_is_not_unicode_is_a_value_error(llm: LLM) -> None:
    """A lone surrogate reached the tokenizer, whose TypeError named no argument."""
    with pytest.raises(ValueError, match="^prompt: not valid Unicode"):
        llm.generate(["fine", "\ud800"], PARAMS)
    assert not llm.engine.has_unfinished_requests() and len(llm.generate("fine", PARAMS)[0].outputs[0].token_ids) == 3
