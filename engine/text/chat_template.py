"""Chat templates: validate chat messages and render a model's jinja chat template in a sandbox.

Templates come from model repositories, i.e. they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` with the same conventions as Hugging Face (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block that renders its body, a
``raise_exception(msg)`` helper, a ``tojson`` filter that does not HTML-escape, ``strftime_now(fmt)``), so a
template renders to the same text as ``transformers``' ``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTENT_TYPES = (str, list, type(None))


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check ``messages`` is a list of ``{"role": str, "content": str | list | None}`` dicts.

    Raises ValueError naming the index of the first bad message. ``content`` may be a list of content parts
    (multimodal style) or None (an assistant turn carrying only ``tool_calls``). Returns plain dict copies.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            "chat messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"got {type(messages).__name__}"
        )
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(
                f"messages[{i}]: must be a dict with 'role' and 'content', got {type(msg).__name__}"
            )
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]: 'role' must be a non-empty string (e.g. 'user'), got {role!r}")
        if "content" not in msg and "tool_calls" not in msg:
            raise ValueError(f"messages[{i}] (role {role!r}): missing 'content'")
        content = msg.get("content")
        if not isinstance(content, _CONTENT_TYPES):
            raise ValueError(
                f"messages[{i}] (role {role!r}): 'content' must be a string, a list of parts or None, "
                f"got {type(content).__name__}"
            )
        out.append(dict(msg))
    return out


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF marks assistant spans with it): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may reference.

    Compiles lazily and drops the compiled form when pickled (Ray ships tokenizers to actors).
    ``now`` fixes what ``strftime_now`` returns, so a template that prints today's date can still render
    reproducibly; by default it is the current local time, as in HF.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be a non-empty jinja string")
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._compiled: jinja2.Template | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "special_tokens": self.special_tokens, "_compiled": None}

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _make_environment().from_string(self.source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
        return self._compiled

    def render(self, messages: object, add_generation_prompt: bool = True, now: datetime | None = None,
               **kwargs: Any) -> str:
        """Render ``messages`` (validated first). Extra ``kwargs`` (e.g. ``tools``) become template variables.

        A ``raise_exception`` call in the template (e.g. roles out of order) becomes a ValueError.
        """
        msgs = validate_messages(messages)
        stamp = now

        def strftime_now(fmt: str) -> str:
            return (stamp if stamp is not None else datetime.now()).strftime(fmt)

        variables: dict[str, Any] = {
            **self.special_tokens, "strftime_now": strftime_now, **kwargs,
            "messages": msgs, "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template().render(variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e


def select_template(chat_template: object) -> str | None:
    """Pick the template string from a tokenizer_config ``chat_template`` value.

    The value is a string, or (older HF format) a list of ``{"name": ..., "template": ...}``; then the one
    named "default" is used, else the first.
    """
    if chat_template is None or isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, list) and chat_template:
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, Mapping)}
        chosen = named.get("default", next(iter(named.values()), None))
        if isinstance(chosen, str):
            return chosen
    raise ValueError(
        "tokenizer_config.json 'chat_template' must be a string or a list of {'name', 'template'} dicts"
    )
