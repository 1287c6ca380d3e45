"""Chat templates: the built-in one, a Hugging Face `tokenizer_config.json` template rendered as transformers
renders it, and a template error as a 400."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagedjax.model.errors import ModelLoadError
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError
from tests.serve.server_utils import MODEL_NAME, make_engine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

# The shape of Llama 3's template (bos_token, trim_blocks/lstrip_blocks whitespace, raise_exception).
LLAMA_LIKE = """{{- bos_token -}}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) -}}
    {% endif %}
    {{- '<|' + message['role'] + '|>' + message['content'] | trim + '<|end|>' -}}
{% endfor %}
{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}
{{- ' ' + {"k": "é"} | tojson if add_generation_prompt is false }}"""


def test_default_template():
    template = ChatTemplate.from_model(None)
    assert template.text == DEFAULT_TEMPLATE and not template.model_template
    text = template.render(MESSAGES)
    assert text == "# system:\nBe brief.\n# user:\nHi\n# assistant:\n"
    assert template.render(MESSAGES, add_generation_prompt=False) == "# system:\nBe brief.\n# user:\nHi\n"
    assert template.encode(ByteTokenizer(), text) == ByteTokenizer().encode(text)  # BOS added, as for a prompt


@pytest.mark.parametrize("form", ["string", "named list", "jinja file", "chat_template.json",
                                  "processor_config.json"])
def test_hugging_face_template(tmp_path, form):
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    if form == "string":
        config["chat_template"] = LLAMA_LIKE
    elif form == "named list":
        config["chat_template"] = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": LLAMA_LIKE}]
    elif form == "jinja file":
        (tmp_path / "chat_template.jinja").write_text(LLAMA_LIKE)
    else:  # a processor's (vision-language folders)
        (tmp_path / form).write_text(json.dumps({"chat_template": LLAMA_LIKE}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_model(tmp_path)
    assert template.model_template
    text = template.render(MESSAGES)
    assert text == "<s><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    transformers = pytest.importorskip("transformers.utils.chat_template_utils")
    assert text == transformers.render_jinja_template([MESSAGES], chat_template=LLAMA_LIKE, bos_token="<s>",
                                                      eos_token="</s>", add_generation_prompt=True)[0][0]
    # The template wrote the special tokens: none are added when tokenizing.
    assert template.encode(ByteTokenizer(), text) == ByteTokenizer().encode(text, add_bos=False)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_override_file_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA_LIKE}))
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert ChatTemplate.from_model(tmp_path, override).render(MESSAGES) == "[Be brief.][Hi]"


def test_broken_tokenizer_config_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        ChatTemplate.from_model(tmp_path)


def test_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="failed"):
        template.render(MESSAGES)


def test_template_error_is_a_400():
    from pagedjax.serve.app import build_app
    from pagedjax.serve.async_engine import AsyncLLMEngine

    app = build_app(AsyncLLMEngine(make_engine()), model_name=MODEL_NAME,
                    chat_template=ChatTemplate("{{ raise_exception('no system messages, please') }}"))
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "no system messages, please" in error["message"]


def test_tojson_keeps_non_ascii(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA_LIKE, "bos_token": "<s>"}))
    text = ChatTemplate.from_model(tmp_path).render(MESSAGES, add_generation_prompt=False)
    assert text == '<s><|system|>Be brief.<|end|><|user|>Hi<|end|> {"k": "é"}'
