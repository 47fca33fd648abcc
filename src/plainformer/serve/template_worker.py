"""A model's chat template compiled and rendered in a process of its own, so that a template that loops for
ever, builds a gigabyte string or computes 10 ** (10 ** 7) costs the server no more than a bounded wait: the
server kills this process past its time (`chat.TemplateRenderer`), the process's address space is capped
(RLIMIT_AS, so that an allocation past it is a MemoryError here), and the output stops at max_chars.

Run as a script by its path, `python -I template_worker.py MEMORY_BYTES`: it imports jinja2 and the standard
library, never the package (nor torch with it), and starts in a tenth of a second. It reads one JSON request
a line on stdin and answers each with one JSON line on stdout:
- {"template"}: compile it (keeping it for what follows) -> {"compiled": true}, {"syntax": "line N: ..."};
- {"template", "context", "max_chars"}: render it -> {"text"}, {"refused": message} (the template's
  raise_exception), {"too_long": max_chars};
and either may answer {"memory": bytes} or {"failed": "Type: message"}.

`environment` is the sandbox both this process and the server (for its own plain template) render with:
transformers' `apply_chat_template`'s, jinja2's immutable sandbox with trim_blocks and lstrip_blocks, a
`raise_exception(message)` and a `tojson` filter; its operators are intercepted (run as they are, through
`call_binop`), which keeps jinja2 from folding `'a' * 10 ** 9` into a constant as it compiles: compiling
then runs no arithmetic of the template's.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


class TemplateError(Exception):
    """`raise_exception` in a template: the messages break one of its rules."""


def environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the serve extra's

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    sandbox = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    sandbox.intercepted_binops = frozenset(sandbox.binop_table)
    sandbox.intercepted_unops = frozenset(sandbox.unop_table)
    sandbox.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    sandbox.globals["raise_exception"] = raise_exception
    return sandbox


def render(template: Any, context: dict[str, Any], max_chars: int, memory: int) -> dict[str, Any]:
    """The answer to a request to render (see the module docstring)."""
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                return {"too_long": max_chars}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except TemplateError as error:
        return {"refused": str(error)}
    except MemoryError:
        return {"memory": memory}
    except Exception as error:  # jinja2's, or the template's own (a TypeError, a RecursionError)
        return {"failed": f"{type(error).__name__}: {error}"}


def compile_template(sandbox: Any, source: str, memory: int) -> tuple[Any, dict[str, Any]]:
    """(the compiled template or None, the answer to a request to compile)."""
    from jinja2 import TemplateSyntaxError

    try:
        return sandbox.from_string(source), {"compiled": True}
    except TemplateSyntaxError as error:  # an unknown filter or test too
        return None, {"syntax": f"line {error.lineno}: {error.message}"}
    except MemoryError:
        return None, {"memory": memory}
    except Exception as error:  # a RecursionError: blocks nested too deeply
        return None, {"failed": f"{type(error).__name__}: {error}"}


def main() -> None:
    memory = int(sys.argv[1])
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ValueError, OSError):  # a platform without it: the server's time limit still holds
        pass
    sandbox, compiled = environment(), {}
    for line in sys.stdin:
        request = json.loads(line)
        source = request["template"]
        if source not in compiled:  # one model, one template: the newest kept
            template, answer = compile_template(sandbox, source, memory)
            compiled = {} if template is None else {source: template}
        if source in compiled:
            answer = (render(compiled[source], request["context"], request["max_chars"], memory)
                      if "context" in request else {"compiled": True})
        sys.stdout.write(json.dumps(answer) + "\n")  # ASCII: a lone surrogate travels as its escape
        sys.stdout.flush()


if __name__ == "__main__":
    main()
