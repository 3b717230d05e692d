"""model.tokenizer on SmolLM2-135M-Instruct's real GGUF (byte-level BPE, ``smollm``
pre-tokenizer) against llama.cpp's token ids, and its chat template.

The reference (tests/data/smollm2-135m-llamacpp.json, a copy of
../shared/reference/smollm2-135m-llamacpp.json) is llama-cpp-python 0.3.36's
``tokenize(text, add_bos=True, special=True)`` on the same GGUF: ``add_bos=True`` there means
"add what the vocabulary adds", which for this one is nothing
(``tokenizer.ggml.add_bos_token = false``), so it is our ``encode(text)`` with its defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.tokenizer import Tokenizer

REFERENCE = json.loads(
    (Path(__file__).parents[1] / "data" / "smollm2-135m-llamacpp.json").read_text(encoding="utf-8")
)
CASES = REFERENCE["cases"]
CASE_IDS = [f"{i}:{c['text'][:24]!r}({len(c['text'])} chars)" for i, c in enumerate(CASES)]
CHAT_CASE = CASES[2]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def metadata() -> dict:
    from model.gguf.reader import read_gguf
    from model.registry import smollm2_135m_path

    return read_gguf(smollm2_135m_path()[0]).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


# --- llama.cpp reference ---------------------------------------------------------------------


def test_reference_is_for_the_registered_file():
    from model.registry import SMOLLM2_REQUIREMENT, SMOLLM2_SHA256

    assert REFERENCE["meta"]["gguf_sha256"] == SMOLLM2_SHA256
    assert REFERENCE["meta"]["model_package"] == SMOLLM2_REQUIREMENT
    assert max(len(c["tokens"]) for c in CASES) == 6143


@slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ids_text_and_pieces_match_llamacpp(tok, case):
    assert tok.encode(case["text"]) == case["tokens"]
    # no BOS was added, and the chat case's control tokens decode to their text
    assert tok.decode(case["tokens"]) == case["text"]
    # the reference's pieces are token_to_piece(special=False) of its top-10 next tokens
    top10 = [tok.decode([i], skip_special_tokens=True) for i in case["top10_ids"]]
    assert top10 == case["top10_pieces"]


# --- vocabulary facts ------------------------------------------------------------------------


@slow
def test_vocabulary(tok, metadata):
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert tok.vocab_size == 49_152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # <|im_start|>, <|im_end|>
    assert tok.encode("Hi") == tok.encode("Hi", add_bos=False)  # add_bos_token = false
    assert tok.encode("Hi", add_bos=True) == [1, *tok.encode("Hi")]


@slow
def test_smollm_splits_digits_one_at_a_time(tok):
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM's first regex is \p{N}: no digit-group tokens, and a
    # space before a number stays its own piece
    assert [tok.piece(i) for i in tok.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]


@slow
def test_control_tokens_are_text_without_special_parsing(tok):
    assert tok.encode("<|im_start|>user") == [1, 4093]
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain and tok.decode(plain) == "<|im_start|>user"


@slow
@pytest.mark.parametrize("text", ["", " ", "  two  spaces ", "tabs\tand\nnewlines\r\n",
                                  "Ünïcödé 日本語 😀🚀 ١٢٣", CASES[3]["text"]])
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


# --- chat template ---------------------------------------------------------------------------


@slow
def test_the_gguf_chat_template_renders_chatml(tok):
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template.source
    messages = [{"role": "system", "content": DEFAULT_SYSTEM},
                {"role": "user", "content": "What is 2+2?"}]
    assert tok.render_chat(messages) == CHAT_CASE["text"]
    assert tok.apply_chat_template(messages) == CHAT_CASE["tokens"]


@slow
def test_the_template_adds_its_system_turn_when_there_is_none(tok):
    user_only = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.render_chat(user_only) == CHAT_CASE["text"]
    assert tok.apply_chat_template(user_only) == CHAT_CASE["tokens"]


@slow
def test_a_finished_conversation_has_no_generation_prompt(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text = tok.render_chat(messages, add_generation_prompt=False)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids.count(1) == 3 and ids.count(2) == 3 and tok.decode(ids) == text
