"""Chat templates rendered exactly as the model's Jinja template says, in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """Compiled once; `render` takes OpenAI-style messages and returns the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source
        self.template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


# Used when a model ships no template: ChatML, the format most small instruct models use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
