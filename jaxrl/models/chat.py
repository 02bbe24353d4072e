"""A conversation as the model's own Hugging Face chat template writes it (the Jinja template in
its tokenizer_config.json), for the OpenAI endpoint and for tasks whose prompts are messages."""

from __future__ import annotations

from jaxrl.errors import UserError


class ChatTemplateError(UserError):
    """The template refused the messages (its `raise_exception`); the message says why."""


def render_chat(template: str, messages: list[dict], tokenizer) -> str:
    """The conversation, ending with the assistant's turn opened (add_generation_prompt), in a
    sandboxed Jinja environment."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True,
        bos_token=getattr(tokenizer, "bos_token", "") or "",
        eos_token=getattr(tokenizer, "eos_token", "") or "")
