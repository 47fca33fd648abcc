"""Chat messages as the prompt a model continues.

A model whose tokenizer came with a `chat_template` (a Hugging Face directory's, kept through training
and checkpoints) renders the messages with it, as transformers' `apply_chat_template` does: jinja2 in an
immutable sandbox, trim_blocks and lstrip_blocks, the tokenizer's bos_token and eos_token,
`add_generation_prompt=True`, a `raise_exception(message)` the template may call and a `tojson`
filter. Any other model gets the plain template, the form Shakespeare's dialogue takes in the bundled
corpus, each message as "ROLE:" on a line of its own and its content below, then the assistant's turn:

    USER:
    How fares the king?

    ASSISTANT:
"""

from __future__ import annotations

import functools
import json
from typing import Any

from ..data.tokenizers import Tokenizer
from .protocol import APIError

PLAIN_TEMPLATE = ("{% for message in messages %}{{ message.role | upper }}:\n{{ message.content }}\n\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")


class TemplateError(Exception):
    """`raise_exception` in a template: the messages break one of its rules."""


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    """The text a model continues to answer `messages` (see the module docstring)."""
    template = _compiled(tokenizer.chat_template or PLAIN_TEMPLATE)
    special = {f"{role}_token": tokenizer.special_tokens.get(role, "") for role in ("bos", "eos")}
    try:
        return template.render(messages=messages, add_generation_prompt=True, **special)
    except TemplateError as error:
        raise APIError(f"the model's chat template refused the messages: {error}", param="messages") from None
    except Exception as error:  # jinja2's own errors: the template is the model's, the fault is not the client's
        raise APIError(f"the model's chat template failed: {type(error).__name__}: {error}", status=500,
                       type="server_error") from None


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the serve extra's

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)
