"""model.tokenizer.chat: chat messages rendered with a Jinja template in the sandbox the way
transformers' apply_chat_template renders them, and tokenized once like a prompt."""

from __future__ import annotations

import json

import jinja2.sandbox
import pytest

from model.gguf.reader import read_gguf
from model.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateMissing,
    Tokenizer,
    TokenizerError,
)
from model.tokenizer.chat import TEMPLATE_KEY, builtin_template

slow = pytest.mark.slow

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
# Gemma 3's turn format, written out by hand for CHAT
GEMMA3_CHAT = (
    "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
    "<start_of_turn>model\nParis.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
)
GENERATION_PROMPT = "<start_of_turn>model\n"


@pytest.fixture(scope="module")
def metadata() -> dict:
    from model.registry import gemma3_270m_path

    return read_gguf(gemma3_270m_path()[0]).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    """The real Gemma 3 270M tokenizer with the chat template the registry gives it."""
    from model.registry import BUILTIN_CHAT_TEMPLATES, GEMMA3_270M

    assert TEMPLATE_KEY not in metadata  # why the registry supplies one
    template = builtin_template(BUILTIN_CHAT_TEMPLATES[GEMMA3_270M])
    return Tokenizer.from_gguf_metadata(metadata, default_chat_template=template)


def template(source: str, **special: str) -> ChatTemplate:
    return ChatTemplate(source, special)


# --- the Gemma 3 template on the real vocabulary --------------------------------------------


@slow
def test_a_three_message_chat_renders_the_gemma3_format(tok, metadata):
    assert tok.render_chat(CHAT) == GEMMA3_CHAT + GENERATION_PROMPT
    ids = tok.apply_chat_template(CHAT)
    assert ids == tok.encode(GEMMA3_CHAT + GENERATION_PROMPT, add_bos=False)
    vocab = metadata["tokenizer.ggml.tokens"]
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # the template's own BOS only
    # the turn markers are parsed as control tokens, not spelled out as text
    assert ids.count(vocab.index("<start_of_turn>")) == 4
    assert ids.count(vocab.index("<end_of_turn>")) == 3
    assert tok.decode(ids) == GEMMA3_CHAT + GENERATION_PROMPT  # control tokens as text


@slow
def test_without_the_generation_prompt_the_chat_ends_after_the_last_turn(tok):
    assert tok.render_chat(CHAT, add_generation_prompt=False) == GEMMA3_CHAT
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == tok.encode(
        GEMMA3_CHAT, add_bos=False)


@slow
def test_a_system_message_opens_the_first_user_turn(tok):
    chat = [{"role": "system", "content": "Answer in one word."}, *CHAT]
    assert tok.render_chat(chat) == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\n"
        "What is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )


@slow
def test_turn_text_is_stripped(tok):
    chat = [{"role": "user", "content": "  Hi there \n\n"}]
    assert tok.render_chat(chat) == "<bos><start_of_turn>user\nHi there<end_of_turn>\n" + (
        GENERATION_PROMPT)


@slow
@pytest.mark.parametrize("roles", [("assistant",), ("user", "user"),
                                   ("system", "assistant"), ("user", "assistant", "assistant")])
def test_turns_out_of_order_raise_the_templates_message(tok, roles):
    chat = [{"role": r, "content": "x"} for r in roles]
    with pytest.raises(ChatTemplateError, match="must alternate user, assistant"):
        tok.apply_chat_template(chat)


@slow
def test_a_template_in_the_gguf_wins_and_gets_the_vocabs_special_tokens(metadata):
    with_template = {**metadata, TEMPLATE_KEY: "{{ bos_token }}|{{ eos_token }}|"
                     "{{ messages | length }}{% if add_generation_prompt %}+{% endif %}"}
    tok = Tokenizer.from_gguf_metadata(with_template, default_chat_template="unused")
    vocab = metadata["tokenizer.ggml.tokens"]
    bos, eos = vocab[metadata["tokenizer.ggml.bos_token_id"]], vocab[
        metadata["tokenizer.ggml.eos_token_id"]]
    assert (bos, eos) == ("<bos>", "<eos>")
    assert tok.render_chat(CHAT) == "<bos>|<eos>|3+"
    assert tok.render_chat(CHAT, add_generation_prompt=False) == "<bos>|<eos>|3"


# --- models without a template ----------------------------------------------------------------


@pytest.mark.parametrize("path_of", ["tiny_gemma3_path", "tiny_deepseek4_path"])
def test_a_model_without_a_template_raises_chat_template_missing(path_of):
    from model.gguf import synthetic

    metadata = read_gguf(getattr(synthetic, path_of)()[0]).metadata
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateMissing, match="no chat template"):
        tok.apply_chat_template(CHAT)
    assert issubclass(ChatTemplateMissing, ChatTemplateError)
    assert issubclass(ChatTemplateError, TokenizerError)  # the worker's input errors


def test_an_unknown_builtin_template_is_missing():
    with pytest.raises(ChatTemplateMissing):
        builtin_template("no-such-template")


# --- the environment: transformers' globals, filters and sandbox -------------------------------


def test_raise_exception_surfaces_as_a_typed_error_with_the_templates_message():
    t = template("{% if messages[0].role != 'user' %}"
                 "{{ raise_exception('first turn must be the user, got ' ~ messages[0].role) }}"
                 "{% endif %}ok")
    assert t.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first turn must be the user, got tool"):
        t.render([{"role": "tool", "content": ""}])


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",          # attribute access to dunders
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ messages.append(1) }}",                  # immutable: no mutating methods
    "{{ messages[0].update(role='system') }}",
])
def test_the_sandbox_refuses_unsafe_access(source):
    with pytest.raises(ChatTemplateError, match="unsafe") as refused:
        template(source).render(CHAT)
    assert isinstance(refused.value.__cause__, jinja2.sandbox.SecurityError)


@pytest.mark.parametrize("source, match", [
    ("{{ range(10 ** 7) | list }}", "Range too big"),   # the sandbox's range cap
    ("{{ messages[0].content + 1 }}", "concatenate"),   # a type error in the template
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
])
def test_errors_while_rendering_are_typed(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        template(source).render(CHAT)


def test_a_template_that_does_not_parse_fails_at_render_not_at_load():
    t = template("{% for m in messages %}{{ m.role }")
    with pytest.raises(ChatTemplateError, match="does not parse: line 1"):
        t.render(CHAT)


def test_tojson_is_transformers_filter_without_html_escaping():
    message = {"role": "user", "content": "<b>Tom & Jerry's</b> \u00e9"}
    t = template("{{ messages[0] | tojson }}\n{{ messages[0] | tojson(indent=2) }}")
    compact, indented = t.render([message]).split("\n", 1)
    assert compact == json.dumps(message, ensure_ascii=False)
    assert indented == json.dumps(message, ensure_ascii=False, indent=2)
    assert "<b>" in compact and "\\u0026" not in compact


def test_loop_controls_and_strftime_now_are_available():
    t = template("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                 "{{ m.role[0] }}{% endfor %}|{{ strftime_now('%Y') | length }}")
    assert t.render(CHAT) == "ua|4"


def test_trim_blocks_and_lstrip_blocks_as_transformers_sets_them():
    t = template("{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n"
                 "    {% endif %}\n{% endfor %}")
    assert t.render(CHAT) == "What is the capital of France?\nAnd of Italy?\n"


def test_undefined_special_tokens_render_empty():
    assert template("[{{ bos_token }}]{% if eos_token is defined %}eos{% endif %}").render(
        CHAT) == "[]"


def test_the_template_is_compiled_once(monkeypatch):
    compiled = []
    original = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string

    def counting(self, source, *args, **kwargs):
        compiled.append(source)
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(jinja2.sandbox.ImmutableSandboxedEnvironment, "from_string", counting)
    t = template("{{ messages | length }}")
    assert [t.render(CHAT[:n]) for n in (1, 2, 3)] == ["1", "2", "3"]
    assert len(compiled) == 1
