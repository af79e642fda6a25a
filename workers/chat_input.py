"""What `LLM.chat` takes, checked before the chat template sees it: conversations of messages,
tools, the template's switches. A client's mistake is a ValueError naming the argument (the
template's renderer answered with jinja's UndefinedError or a TypeError), and OpenAI's text
content parts are joined into the text the template reads, as vLLM's `LLM.chat` joins them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


def conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[list[dict[str, Any]]]:
    """One conversation (its first item a message) or a list of them, as checked lists of
    messages, each content a string (text parts joined by newlines) or None."""
    if not isinstance(messages, (list, tuple)) or not messages:  # (a str is a Sequence too)
        raise ValueError("messages: a non-empty list of {'role': ..., 'content': ...} messages, or a list of "
                         "such lists")
    convs = [messages] if isinstance(messages[0], Mapping) else messages
    out = []
    for c, conv in enumerate(convs):
        where = "messages" if len(convs) == 1 and convs is not messages else f"messages[{c}]"
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"{where}: a conversation is a non-empty list of {{'role': ..., 'content': ...}} "
                             "messages")
        out.append([_message(f"{where}[{i}]", m) for i, m in enumerate(conv)])
    return out


def _message(where: str, m: object) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise ValueError(f"{where}: a message is a {{'role': ..., 'content': ...}} mapping, got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role: must be a non-empty string, got {role!r}"[:200])
    content = m.get("content")
    if isinstance(content, (list, tuple)):
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content: must be a string, a list of text parts or null, got "
                         f"{type(content).__name__}")
    if content is None and not m.get("tool_calls"):
        content = ""  # what the template reads for a message without text (an assistant's tool calls aside)
    if content is not None:
        _unicode(f"{where}.content", content)
    return {**m, "content": content}


def _text_part(where: str, part: object) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise ValueError(f"{where}: text content parts only ({{'type': 'text', 'text': ...}}), got {kind!r}"[:200])
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text: must be a string, got {type(text).__name__}")
    return text


def check_tools(tools: object) -> list[dict[str, Any]] | None:
    """OpenAI's tools: None, or a list of {"type": "function", "function": {"name": ...}}."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools: a list of {{'type': 'function', 'function': {{'name': ...}}}}, got "
                         f"{type(tools).__name__}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    return [dict(t) for t in tools]


def check_switches(chat_template: object, add_generation_prompt: object, continue_final_message: object) -> None:
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template: must be the template's text, got {type(chat_template).__name__}")
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, got {value!r}"[:200])


def _unicode(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate)") from None
