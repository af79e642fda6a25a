"""vLLM's `--chat-template`: a chat template given to the server in place of the tokenizer's own
(a base model's tokenizer has none; a fine-tune's may be wrong), as a file or as the template.

It is read where the server's settings are made (the driver, or a Serve YAML's builder) and
travels with them as text: a gateway replica on another node need not have the file. It is
parsed there too, so that a broken template stops the start, not every chat request.
"""

from __future__ import annotations

import os

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KiB (Llama 3.1's with tools: ~5)


def load_chat_template(value: str) -> str:
    """The template `value` names: a file's text, or `value` itself when it is a template (it has
    Jinja's `{`). A ValueError naming the setting for a path that is not a readable file, or a
    template Jinja cannot parse."""
    path = os.path.expanduser(value)
    if "{" not in value:  # not a template: a file
        if not os.path.isfile(path):
            raise ValueError(f"chat_template: {value} is not a file on this machine (nor a Jinja template)")
        if os.path.getsize(path) > MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat_template: {value} is over {MAX_TEMPLATE_BYTES >> 20} MiB")
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: {path} cannot be read: {e}") from None
    try:
        # As transformers renders chat templates (its sandbox, with loop controls).
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a template Jinja can parse: line {e.lineno}: {e.message}") from None
    return value
