"""A conversation as the model's own Hugging Face chat template writes it (the Jinja template in
its tokenizer_config.json), for the OpenAI endpoint and for tasks whose prompts are messages."""

from __future__ import annotations

from jaxrl.errors import UserError


class ChatTemplateError(UserError):
    """The template refused the messages (its `raise_exception`); the message says why."""


def render_chat(template: str, messages: list[dict], tokenizer,
                tools: list[dict] | None = None) -> str:
    """The conversation, ending with the assistant's turn opened (add_generation_prompt), in a
    sandboxed Jinja environment with what Hugging Face's apply_chat_template gives templates
    (`tools`, `tojson` without HTML escaping, `strftime_now`, loop controls)."""
    import datetime
    import json

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=True,
                               bos_token=getattr(tokenizer, "bos_token", "") or "",
                               eos_token=getattr(tokenizer, "eos_token", "") or "")
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from None

