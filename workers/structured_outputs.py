"""What a request's output must match (vLLM's `StructuredOutputsParams`): a JSON schema, any
JSON object, a regular expression, one of a list of strings, an EBNF grammar or a structural
tag. Checked for shape where it is built; whether the backend can compile it is the grammar
compiler's (workers/grammar.py) to say, also before any token is generated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The kinds, in the order vLLM's `structured_outputs` names them (one per request).
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Bounds on what a client may send: a grammar is compiled into an automaton whose size
# grows with its text, so a huge one is refused before it costs anything.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
# A JSON schema's compile time grows much faster than its text: 1,000 optional properties
# took xgrammar 1.7 s, 2,000 took 30 s, and a compile cannot be stopped (its thread is held
# past the request's 400), so cheap schemas could hold every compile thread for minutes.
MAX_SCHEMA_PROPERTIES = 1024  # in all the schema's objects (many tools' schemas under "required" add up)
MAX_SCHEMA_DEPTH = 32  # objects and arrays inside each other
# JSON Schema keywords xgrammar (0.2.9) compiles as if they were absent, so that what it lets
# through is no instance of the schema ([1, 1] under uniqueItems, 0 under not {const: 0}, `then`
# never applied): refused, as vLLM's xgrammar backend refuses uniqueItems and contains, rather than
# promise an instance of the schema and break it. So is allOf of more than one schema (xgrammar
# warns and allows any JSON value).
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                       "dependentRequired", "dependentSchemas")
# Escapes of characters JSON must escape in a string (backslash, quote, controls): xgrammar writes a
# pattern's literal characters into the JSON string as they are ('^a"b$' gave '"a"b"', no JSON).
# In a character class it leaves them out itself.
_RAW_IN_JSON = frozenset('\\"nrtfv0')
# Where a schema holds schemas (not data, as `const`, `enum` and `default` do; nor names, as
# `required` does): one, a map of them, a list of them.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedItems",
              "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
# Bounds JSON Schema wants non-negative integers.
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the fields is set. `json`: a JSON schema (its text, or the parsed
    object: kept as canonical text); `json_object`: any JSON object; `regex`, `choice`,
    `grammar` (EBNF, xgrammar's dialect of GBNF) and `structural_tag` (its JSON text)."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's options beside the kind, taken so that a request written for vLLM runs: pdserve has
    # one backend (no fallback to disable) and compiles JSON without free whitespace, so the two
    # `disable_*` flags ask nothing it does not do already; the other two are xgrammar-less
    # backends' in vLLM too, refused when they would change anything.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The request field it came from, for errors (an OpenAI client's response_format); "": its own.
    origin: str = ""
    # A token the output must have before the grammar applies, from after its first one (a thinking
    # model's end of thinking: the gateway sets it with a reasoning parser, as vLLM applies a grammar
    # after the reasoning); None: from the first token.
    after_token: int | None = None

    def __post_init__(self) -> None:
        for flag in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag}: must be a boolean, got {getattr(self, flag)!r}")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties: not supported (vLLM's guidance "
                             "backend only); set additionalProperties: false in the schema")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern: not supported (JSON is generated without "
                             "free whitespace)")
        given = [k for k in KINDS if (getattr(self, k) is not None and k != "json_object") or
                 (k == "json_object" and self.json_object)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be given, "
                             f"got {', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object: must be a boolean, got {self.json_object!r}")
        after: object = self.after_token
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
            raise ValueError(f"structured_outputs.after_token: must be a token id, got {after!r}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _json_text(f"structured_outputs.{name}", value))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            choice: object = self.choice  # a client's value: checked, whatever the annotation says
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices, got {len(choice)}")
            object.__setattr__(self, "choice", tuple(choice))
        size = len(self.key()[1])
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"{self.field}: at most {MAX_SPEC_CHARS} characters, got {size}")
        # A structural tag's schemas compile as a JSON schema's do (600 properties: 1.35 s in a tag,
        # 1.30 s as `json`), so the same bounds, counted over the whole tag; unchecked, a tag took
        # the compile threads for as long as the bounds were there to prevent.
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):  # (canonical text by now)
                _check_schema_size(self.field, json.loads(value))
        if isinstance(self.json, str):
            _check_schema_enforced(self.field, json.loads(self.json))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (k == "json_object" and self.json_object) or
                    (k != "json_object" and getattr(self, k) is not None))

    @property
    def field(self) -> str:
        """The request field an error names."""
        return self.origin or f"structured_outputs.{self.kind}"

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on, the compile cache's key."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            assert self.choice is not None
            return kind, json.dumps(list(self.choice))
        value = getattr(self, kind)
        assert isinstance(value, str)
        return kind, value


def _check_schema_size(name: str, schema: object) -> None:
    """A ValueError naming `name` when the schema has more properties, or deeper nesting,
    than a compile can take in a bounded time (MAX_SCHEMA_PROPERTIES, MAX_SCHEMA_DEPTH)."""
    properties = 0
    todo: list[tuple[object, int]] = [(schema, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{name}: nested more than {MAX_SCHEMA_DEPTH} deep")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise ValueError(f"{name}: more than {MAX_SCHEMA_PROPERTIES} properties in all")
            todo += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            todo += [(v, depth + 1) for v in node]


def _check_schema_enforced(name: str, schema: object) -> None:
    """A ValueError naming `name` and the keyword when the schema uses one the backend would not
    hold the output to (UNENFORCED_KEYWORDS, allOf of several schemas). Only schema positions
    are read: a property named "not", or a `const` object with an "if" key, is no keyword."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        used = [k for k in UNENFORCED_KEYWORDS if k in node and not (k == "uniqueItems" and node[k] is False)]
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            used.append("allOf")
        if used:
            raise ValueError(f"{name}: {used[0]} is not supported (the output would not be held to it)")
        _check_schema_node(name, node)
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            if _raw_in_json(pattern):
                raise ValueError(f"{name}: pattern {pattern[:64]!r}: a literal quote, backslash or control "
                                 f"character outside [...] is not supported (it would be written unescaped)")
        todo += [node[k] for k in _SUBSCHEMA if k in node]
        todo += [v for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict) for v in node[k].values()]
        todo += [v for k in _SUBSCHEMA_LISTS if isinstance(node.get(k), list) for v in node[k]]


def _check_schema_node(name: str, node: dict[str, Any]) -> None:
    """A ValueError naming `name` where one schema (not its subschemas) is one the backend would
    turn into output that is not an instance of it: xgrammar took each of these and wrote ""
    (an empty anyOf, no JSON at all), "" for a remote $ref (ignored), `{}` against a required
    property that additionalProperties false forbids, and read a negative bound as 0."""
    for key in ("anyOf", "oneOf"):
        if node.get(key) == []:
            raise ValueError(f"{name}: {key} must hold at least one schema (no value can match an empty one)")
    for key in _COUNTS:
        value = node.get(key)
        if key in node and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name}: {key} must be a non-negative integer, got {value!r}")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"{name}: $ref {ref[:64]!r}: only references inside the schema (\"#/...\") are "
                         "supported (nothing is fetched)")
    required, properties = node.get("required"), node.get("properties")
    if node.get("additionalProperties") is False and isinstance(required, list) and "patternProperties" not in node:
        known = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if isinstance(r, str) and r not in known]
        if missing:
            raise ValueError(f"{name}: required property {missing[0][:64]!r} is not in properties, and "
                             "additionalProperties is false: no object can match")


def _raw_in_json(pattern: str) -> bool:
    """Whether `pattern` has, outside a character class, a literal character a JSON string must
    escape (a quote, a control character, or one written as an escape: \\\\, \\n, ...)."""
    in_class, i = False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if not in_class and pattern[i + 1:i + 2] in _RAW_IN_JSON:
                return True
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == '"' or ord(c) < 0x20:
            return True
        i += 1
    return False


def _json_text(name: str, value: object) -> str:
    """Canonical JSON text of a schema given as text or as an object (the cache sees one
    schema once, whatever its key order or spacing)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{name}: not valid JSON: {type(e).__name__}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # the grammar's parser takes no lone surrogate
        return json.dumps(value, separators=(",", ":"), allow_nan=False)  # key order kept: it is the output's
    except UnicodeEncodeError:
        raise ValueError(f"{name}: not valid Unicode (a lone surrogate)") from None
    except RecursionError:
        raise ValueError(f"{name}: nested more than {MAX_SCHEMA_DEPTH} deep") from None
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
