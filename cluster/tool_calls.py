"""Tool calls (OpenAI's `tools` and `tool_choice`): what a chat request's tools make of its
output.

- `"none"` (or no tools): free text.
- a named function: the output is made (by a grammar: structured outputs) to be that
  function's arguments, a JSON instance of its `parameters` schema; one call.
- `"required"`: the output is made to be a JSON array of one or more `{"name", "parameters"}`
  objects, each naming a tool and holding arguments of its schema (at most
  MAX_PARALLEL_CALLS; one when `parallel_tool_calls` is false). Even a small model returns
  valid calls.
- `"auto"`: the model decides; its text is parsed for the tool-call formats of the families
  pdserve loads: Hermes / Qwen2.5 (`<tool_call>{"name", "arguments"}</tool_call>`, any
  number), Mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`) and Llama 3.x (the whole
  answer JSON objects `{"name", "parameters"}` separated by ";", after an optional `<|python_tag|>`).
  Text that is none of these is the answer's content.

The tools reach the model through its chat template (transformers' `apply_chat_template(tools=...)`).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from pdserve.workers.structured_outputs import MAX_SCHEMA_DEPTH, StructuredOutputs

Mode = Literal["none", "auto", "required", "named"]
# What a streamed answer under "auto" may start with when it is a tool call: held back (not
# streamed as content) while the text so far could be the start of one of these.
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{")
# The formats whose calls may follow words (Hermes, Qwen2.5 and Qwen3 after their thinking,
# Mistral): a streamed answer in words is watched for these to its end.
INLINE_MARKERS = ("<tool_call>", "[TOOL_CALLS]")
# Calls one "required" answer may hold: the grammar's array ends by then. Unbounded, a small model
# can repeat calls until max_tokens cuts the array short (SmolLM2: 2 of 100 answers did at 400
# tokens, bench/structured_served.py), and a cut-short array is no call at all.
MAX_PARALLEL_CALLS = 8
# vLLM's --tool-call-parser names of the formats "auto" answers are parsed for, and the markers
# an answer in each begins with (None, the default here: every format).
ToolParser = Literal["hermes", "mistral", "llama3_json"]
TOOL_FORMATS: dict[str, tuple[str, ...]] = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                                            "llama3_json": ("<|python_tag|>", "{")}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class StreamedToolCall(ToolCall):
    index: int


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools and what its `tool_choice` asks of the output."""

    mode: Mode
    tools: tuple[dict[str, Any], ...]  # each tool's `function` object: name, description, parameters
    name: str | None = None  # the named function (mode "named")
    parallel: bool = True
    parser: ToolParser | None = None  # the one format "auto" answers are parsed for (None: each)

    @property
    def markers(self) -> tuple[str, ...]:
        """What an "auto" answer that is a call may begin with, in the formats parsed."""
        return CALL_MARKERS if self.parser is None else TOOL_FORMATS[self.parser]

    @property
    def inline_markers(self) -> tuple[str, ...]:
        """The markers, among those parsed, of calls that may follow words."""
        return tuple(m for m in INLINE_MARKERS if m in self.markers)

    @classmethod
    def of(cls, tools: list[dict[str, object]] | None, tool_choice: str | dict[str, object] | None,
           parallel: bool | None) -> ToolPlan:
        """The plan of a request's fields; a ValueError names the field at fault."""
        functions = tuple(_function(i, t) for i, t in enumerate(tools or ()))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        # Only a missing tool_choice takes a default: an empty one ({} or "") is refused below.
        choice = ("auto" if functions else "none") if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError('tool_choice: must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
            if name not in names:
                raise ValueError(f"tool_choice: {name!r} is not one of the tools")
            return cls("named", functions, name, parallel is not False)
        if choice not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}')
        if choice != "none" and not functions:
            raise ValueError(f'tool_choice: "{choice}" needs tools')
        return cls(choice, functions, None, parallel is not False)  # type: ignore[arg-type]  # one of the three

    @property
    def active(self) -> bool:
        """Whether tool calls may come back (the answer is parsed for them)."""
        return self.mode != "none"

    def template_tools(self, exclude_if_none: bool = False) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (None: the prompt mentions none). Under
        tool_choice "none" the model still sees them, as OpenAI's and vLLM's do (the answer is
        not parsed for calls), unless `exclude_if_none` (vLLM's --exclude-tools-when-tool-choice-none)."""
        if not self.tools or (exclude_if_none and not self.active):
            return None
        return [{"type": "function", "function": f} for f in self.tools]

    def constraint(self) -> StructuredOutputs | None:
        """The grammar that makes the output a valid call ("named", "required"); None otherwise."""
        if self.mode == "named":
            fn = next(f for f in self.tools if f["name"] == self.name)
            return StructuredOutputs(json=fn.get("parameters") or {"type": "object"}, origin="tools")
        if self.mode == "required":
            # Each tool's schema moves under the array's items: its own references ("#/$defs/X",
            # what pydantic writes for a nested model; "#/properties/...") must follow it there.
            at = ["/items"] if len(self.tools) == 1 else [f"/items/anyOf/{i}" for i in range(len(self.tools))]
            items = [{"type": "object", "properties": {
                "name": {"const": f["name"]},
                "parameters": _rebased(f.get("parameters") or {"type": "object"}, f"{where}/properties/parameters")},
                "required": ["name", "parameters"], "additionalProperties": False}
                for f, where in zip(self.tools, at, strict=True)]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            schema["maxItems"] = MAX_PARALLEL_CALLS if self.parallel else 1
            return StructuredOutputs(json=schema, origin="tools")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole answer. Under "named" and "required" the grammar
        made `text` a call (a cut-short one, at max_tokens, stays content)."""
        if self.mode == "named":
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.mode == "required":
            items = _json(text)
            if not isinstance(items, list):
                return text, []
            return None, [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        if self.mode == "auto":
            found = parse_calls(text, {f["name"] for f in self.tools}, self.parser)
            if found is not None:
                content, calls = found
                # parallel_tool_calls false: at most one call (OpenAI's contract; vLLM keeps the first)
                return content, calls if self.parallel else calls[:1]
        return text, []

    def may_be_call(self, text: str) -> bool:
        """Whether a streamed "auto" answer that begins with `text` may still be a tool call."""
        head = text.lstrip()
        return any(head.startswith(m) or m.startswith(head) for m in self.markers)

    def words_end(self, text: str, start: int = 0) -> int:
        """How much of a streamed "auto" answer in words is words for sure: up to the first
        call marker in it (INLINE_MARKERS; none starts before `start`, what was judged words
        already), else all but a last few characters that may be the start of one."""
        inline = self.inline_markers
        found = [i for m in inline if (i := text.find(m, start)) >= 0]
        if found:
            return min(found)
        longest = max((len(m) for m in inline), default=1) - 1
        for k in range(min(longest, len(text) - start), 0, -1):
            if any(m.startswith(text[-k:]) for m in inline):
                return len(text) - k
        return len(text)


def parse_calls(text: str, names: set[str],
                parser: ToolParser | None = None) -> tuple[str | None, list[ToolCall]] | None:
    """The tool calls in a model's own format (module docstring; `parser`: that format only),
    with the content before them; None when `text` holds none that name a tool."""
    stripped = text.strip()
    found: list[tuple[object, object]] = []
    content: str | None = None
    if parser in (None, "hermes") and "<tool_call>" in stripped:  # Hermes, Qwen2.5, Qwen3
        content = _words_before(text, "<tool_call>")
        for body in _HERMES.findall(stripped):
            obj = _json(body)
            if not isinstance(obj, dict):
                return None  # a call that does not parse: the whole answer stays words (as vLLM's parser)
            found.append((obj.get("name"), obj.get("arguments", obj.get("parameters", {}))))
    elif parser in (None, "mistral") and "[TOOL_CALLS]" in stripped:  # Mistral
        content = _words_before(text, "[TOOL_CALLS]")
        obj = _json(stripped.split("[TOOL_CALLS]", 1)[1])
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict):
                return None
            found.append((item.get("name"), item.get("arguments", item.get("parameters", {}))))
    elif parser in (None, "llama3_json"):  # Llama 3.x: the whole answer is the calls, their arguments named
        for obj in _json_objects(stripped.removeprefix("<|python_tag|>")) or ():
            if not ("name" in obj and ("parameters" in obj or "arguments" in obj)):
                return None
            found.append((obj.get("name"), obj.get("parameters", obj.get("arguments", {}))))
    calls = []
    for name, args in found:
        # A call to a tool the request does not have, or arguments that are not an object (nor
        # the JSON text of one): the whole answer stays words, as for a call that does not parse.
        # Dropped alone, it vanished without trace when a known call stood beside it; kept, its
        # arguments went out as text that is not JSON ("not json", or "5" for an object).
        if not isinstance(name, str) or name not in names:
            return None
        if isinstance(args, str) and isinstance(_json(args), dict):
            calls.append(_call(name, args))  # the JSON text of the object, as the model wrote it
        elif isinstance(args, dict):
            calls.append(_call(name, json.dumps(args, ensure_ascii=False)))
        else:
            return None
    return (content, calls) if calls else None


def _words_before(text: str, marker: str) -> str | None:
    """The words before a call's marker, as they are (what a stream sends of them, and vLLM's
    whole answer's content); None when there are none but whitespace."""
    words = text[: text.index(marker)]
    return words if words.strip() else None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates read them: an assistant's tool calls carry their
    arguments as objects, not JSON text (what transformers' templates index into)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _json(c["function"].get("arguments", "{}"))
                                                        if isinstance(c["function"].get("arguments"), str)
                                                        else c["function"].get("arguments")}}
                                     for c in calls]}
        out.append(m)
    return out


def _function(i: int, tool: dict[str, object]) -> dict[str, Any]:
    fn = tool.get("function")
    if tool.get("type") != "function" or not isinstance(fn, dict):
        raise ValueError(f'tools: tool {i} must be {{"type": "function", "function": {{"name": ...}}}}')
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ValueError(f"tools: tool {i}'s name must be 1-64 letters, digits, '_', '.' or '-'")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"tools: tool {i}'s description must be a string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools: tool {i}'s parameters must be a JSON schema object")
    if isinstance(params, dict) and not isinstance(params.get("properties", {}), dict):
        raise ValueError(f"tools: tool {i}'s parameters.properties must be an object")  # templates iterate it
    if _deeper_than(params, MAX_SCHEMA_DEPTH):  # a chat template renders it recursively
        raise ValueError(f"tools: tool {i}'s parameters are nested more than {MAX_SCHEMA_DEPTH} deep")
    return dict(fn)


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, at: str) -> Any:
    """`schema` with each local reference ("#", "#/...": a JSON pointer into it) pointing
    to the same place once the schema sits at JSON pointer `at` of a larger one."""
    if isinstance(schema, list):
        return [_rebased(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, at)
    return out


def _call(name: str, arguments: str) -> ToolCall:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _deeper_than(value: object, limit: int) -> bool:
    """Whether `value` has objects and arrays nested more than `limit` deep (no recursion)."""
    todo: list[tuple[object, int]] = [(value, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            todo += [(v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return False


def _json(text: str) -> object:
    """`text` as JSON, or None where it is not: NaN and Infinity too, which Python's parser takes
    but JSON has not, and a number past a float's range (1e999), which it reads as infinity (a
    call's arguments go to the client as JSON text: written again, either was `Infinity`)."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack: no call
        return None


def _json_objects(text: str) -> list[dict[str, Any]] | None:
    """`text` as JSON objects separated by ";" (a last one allowed: how Llama 3.x writes more
    than one call, and vLLM's llama3_json parser reads them), or None where it is not that whole."""
    objects: list[dict[str, Any]] = []
    at = 0
    while True:
        try:
            obj, at = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        objects.append(obj)
        gap = _BETWEEN_CALLS.match(text, at)
        assert gap is not None  # (it matches the empty string)
        at = gap.end()
        if at == len(text):
            return objects
        if not gap.group(1):  # another object, with no ";" before it
            return None


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{literal[:40]} is past a float's range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)
_BETWEEN_CALLS = re.compile(r"\s*(;)?\s*")
