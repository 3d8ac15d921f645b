"""Chat messages → prompt token ids through the model's (or the operator's) Jinja chat template."""
from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from .errors import bad_request


def load_chat_template(value: str | None, base_dir: Path | None = None) -> str | None:
    """`--chat-template` is a file path or the template text itself (anything with a Jinja tag)."""
    if value is None:
        return None
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a Jinja template")


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict | None,
) -> list[int]:
    """Render and tokenize a conversation; template problems are the client's 400, not a crash."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("This model has no chat template; start the server with --chat-template.")
    try:
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        options.update(template_kwargs or {})  # the request's chat_template_kwargs win, as in vLLM
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
    except (TemplateError, ValueError, TypeError) as exc:
        raise bad_request(f"Cannot apply the chat template to these messages: {exc}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
