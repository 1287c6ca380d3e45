"""Chat prompts: a list of messages rendered into one prompt with the model's chat template.

A Hugging Face folder's template is `chat_template` in its `tokenizer_config.json` (a string, or a list of `{"name",
"template"}` from which "default" is used), or a sibling `chat_template.jinja`, or its processor's (vision-language
folders): `chat_template` in `chat_template.json` or `processor_config.json`. It is rendered with jinja2 the way
transformers renders it: a sandboxed environment with `trim_blocks` and `lstrip_blocks`, loop controls,
transformers' `{% generation %}` block (rendered as its body; LLaVA's templates mark the assistant's text with it),
`raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` that keeps non-ASCII text, and the variables `messages`
(`role` / `content` dicts), `add_generation_prompt`, `bos_token` and `eos_token`, and `tools` (OpenAI's tool dicts)
when the request offers tools and the template uses that variable (`supports_tools`; a template that does not gets
the tools as a system-prompt preamble instead: `pagedjax.serve.tools`); the text is tokenized without adding special
tokens again (the template writes them).

Images (`pagedjax.serve.images`): a message with image parts has a list `content` of `{"type": "text", "text"}`
and `{"type": "image"}` parts, in the request's order, as transformers gives them; the template writes the model's
placeholder for each image. Every other message keeps its string content, unless the template reads text only
from content parts (`reads_content_parts`: LLaVA's Hugging Face templates drop a string content) and the model
takes images: then every message's text goes to it as parts too.

A vision-language folder without one (a "llava" or "gemma3" `model_type` in its config.json) gets its family's
built-in template (`FAMILY_TEMPLATES`, as vLLM ships fallback templates): the family's own prompt format (LLaVA
1.5's `USER: <image>\n... ASSISTANT:`, Gemma 3's turns), writing the folder's image placeholder (the processor's:
`pagedjax.model.multimodal.processor.image_placeholder`) for each image part, so that image chats work without a
hand-written template; its `source` says so, and the server logs it at start-up. Any other model without one (the
bundled model, trained on Python sources) gets `DEFAULT_TEMPLATE`: each message as a `# <role>:` comment line followed
by its content, then `# assistant:` when a reply is wanted; that text is tokenized like a completion prompt (BOS
added). `--chat-template FILE` replaces any of these.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "# {{ message['role'] }}:\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


# The families' own prompt formats, for a vision-language folder that ships no template: each writes
# `image_placeholder` (the folder's, `ChatTemplate(image_placeholder=...)`) for an image part, and takes a message's
# content as a string or as parts. LLaVA 1.5's renders as llava-hf's template does (images first, then the text, each
# text followed by a space; no role for a system message), with the BOS it leaves to the processor written first
# (the server adds no special tokens to a model template's text).
LLAVA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{- message['role'] | upper + ': ' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] + ' ' -}}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{- image_placeholder + '\n' -}}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] + ' ' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)
# Gemma 3's turns, as its published template renders them: a first system message prefixes the first turn, the
# assistant is "model", text is trimmed, an image part is the placeholder where it stands.
GEMMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] if messages[0]['content'] is string else messages[0]['content']"
    " | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- set prefix = system + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + (prefix if loop.first else '') -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{{- image_placeholder if part['type'] == 'image' else part['text'] | trim -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
FAMILY_TEMPLATES = {"llava": LLAVA_TEMPLATE, "gemma3": GEMMA3_TEMPLATE}


class ChatTemplateError(ValueError):
    """The template failed to render these messages (e.g. it called raise_exception)."""


def _generation_tag():
    """transformers' `{% generation %} ... {% endgeneration %}` (it marks the assistant's text for training masks):
    its body, rendered as it is."""
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: plain JSON, non-ASCII kept (jinja2's own escapes HTML characters)
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=False)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


class ChatTemplate:
    """A compiled chat template. `from_model` finds a model folder's own; `source` says where it came from."""

    def __init__(self, template: str, *, source: str = "built-in default", model_template: bool = False,
                 bos_token: str = "", eos_token: str = "", image_placeholder: str | None = None):
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        if image_placeholder is not None:  # what `FAMILY_TEMPLATES` write for an image part
            env.globals["image_placeholder"] = image_placeholder
        self.text = template
        self.source = source
        self.model_template = model_template  # the model's own: it writes special tokens itself
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = env.from_string(template)
        # A template that reads `tools` renders them itself (transformers passes them the same way).
        self.supports_tools = "tools" in meta.find_undeclared_variables(env.parse(template))

    @classmethod
    def from_model(cls, folder: str | Path | None, override: str | Path | None = None) -> ChatTemplate:
        """The template for a model folder: `override` (a file) if given, else the folder's own, else its
        vision-language family's (`FAMILY_TEMPLATES`), else the built-in default."""
        from pagedjax.model.errors import read_json

        config = {}
        if folder is not None and (Path(folder) / "tokenizer_config.json").is_file():
            config = read_json(Path(folder) / "tokenizer_config.json")  # ModelLoadError naming the file
        tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
        if override is not None:
            return cls(Path(override).read_text(encoding="utf-8"), source=str(override), model_template=True,
                       **tokens)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            return cls(template, source=f"{folder}/tokenizer_config.json", model_template=True, **tokens)
        if folder is not None and (Path(folder) / "chat_template.jinja").is_file():
            return cls((Path(folder) / "chat_template.jinja").read_text(encoding="utf-8"),
                       source=f"{folder}/chat_template.jinja", model_template=True, **tokens)
        for name in ("chat_template.json", "processor_config.json"):  # a processor's (vision-language folders)
            if folder is not None and (Path(folder) / name).is_file():
                template = read_json(Path(folder) / name).get("chat_template")
                if isinstance(template, str):
                    return cls(template, source=f"{folder}/{name}", model_template=True, **tokens)
        family = read_json(Path(folder) / "config.json").get("model_type") \
            if folder is not None and (Path(folder) / "config.json").is_file() else None
        if family in FAMILY_TEMPLATES:
            from pagedjax.model.multimodal.processor import image_placeholder

            return cls(FAMILY_TEMPLATES[family], source=f"built-in {family} template ({folder} has no chat template)",
                       model_template=True, image_placeholder=image_placeholder(folder), **tokens)
        return cls(DEFAULT_TEMPLATE, **tokens)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               ) -> str:
        """The prompt text for `messages` (dicts with "role" and "content"); `tools` (OpenAI's tool dicts) are
        passed only when given, so a template's `tools is defined` tests hold; ChatTemplateError if it fails."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja2's errors (undefined names, sandbox violations, ...)
            raise ChatTemplateError(f"the chat template ({self.source}) failed: {type(e).__name__}: {e}") from e

    @functools.cached_property
    def reads_content_parts(self) -> bool:
        """Whether the template writes a message's text given as content parts but not given as a string (a probe
        message rendered both ways; a template that fails on both is taken as reading strings)."""
        probe = "pagedjax-content-probe"

        def renders(content) -> bool:
            try:
                return probe in self.render([{"role": "user", "content": content}])
            except ChatTemplateError:
                return False

        return not renders(probe) and renders([{"type": "text", "text": probe}])

    def encode(self, tokenizer, text: str) -> list[int]:
        """Token ids of a rendered prompt: the model's own template wrote its special tokens, so none are added;
        the default template's prompt is tokenized like a completion prompt."""
        from pagedjax.serve.admission import encode_text

        if not self.model_template:
            return encode_text(tokenizer, text)
        from pagedjax.model.tokenizer import ByteTokenizer

        if isinstance(tokenizer, ByteTokenizer):
            return tokenizer.encode(text, add_bos=False)
        return encode_text(tokenizer, text, add_special_tokens=False)
