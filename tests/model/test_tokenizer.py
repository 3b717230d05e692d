"""model.tokenizer against llama.cpp's token ids for Gemma 3 270M, plus edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.tokenizer import Tokenizer, TokenizerError

REFERENCE = json.loads(
    (Path(__file__).parents[1] / "data" / "gemma3-270m-llamacpp.json").read_text(encoding="utf-8")
)
CASES = REFERENCE["cases"]
CASE_IDS = [f"{i}:{c['text'][:24]!r}({len(c['text'])} chars)" for i, c in enumerate(CASES)]

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def metadata() -> dict:
    from model.gguf.reader import read_gguf
    from model.registry import gemma3_270m_path

    return read_gguf(gemma3_270m_path()[0]).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def token_id(metadata):
    ids = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    return ids.__getitem__


# --- llama.cpp reference ---------------------------------------------------------------


@slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_encode_matches_llamacpp(tok, case):
    assert tok.encode(case["text"]) == case["tokens"]


@slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_piece_matches_llamacpp_top10(tok, case):
    # the reference's pieces are llama.cpp's token_to_piece(special=False): <eos> gives ""
    pieces = [tok.decode([i], skip_special_tokens=True) for i in case["top10_ids"]]
    assert pieces == case["top10_pieces"]


@slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_of_llamacpp_ids_gives_the_text_and_its_bos(tok, case):
    # llama.cpp's detokenize(special=True): a control token's piece is its text
    assert tok.decode(case["tokens"]) == "<bos>" + case["text"]
    assert tok.decode(case["tokens"], skip_special_tokens=True) == case["text"]


@slow
def test_reference_has_long_cases():
    assert max(len(c["tokens"]) for c in CASES) > 5000


# --- vocabulary facts ----------------------------------------------------------------------


@slow
def test_ids_and_size(tok, metadata):
    assert tok.vocab_size == len(metadata["tokenizer.ggml.tokens"]) == 262_144
    assert tok.bos_id == 2
    assert tok.eos_id == 1


@slow
def test_add_bos_false_omits_bos(tok, token_id):
    assert tok.encode("Hello", add_bos=False) == [token_id("Hello")]
    assert tok.encode("Hello") == [tok.bos_id, token_id("Hello")]
    assert tok.encode("", add_bos=False) == []


# --- whitespace ----------------------------------------------------------------------------


def _space_run_ids(n: int, token_id) -> list[int]:
    """llama.cpp cuts the longest space-run token (31) first; one leftover space is "▁"."""
    ids = []
    while n > 0:
        k = min(n, 31)
        ids.append(token_id("\u2581") if k == 1 else token_id(" " * k))
        n -= k
    return ids


@slow
@pytest.mark.parametrize("n", range(2, 41))
def test_space_runs(tok, token_id, n):
    assert tok.encode(" " * n, add_bos=False) == _space_run_ids(n, token_id)


@slow
def test_forty_spaces_is_31_then_9(tok, token_id):
    assert tok.encode(" " * 40) == [tok.bos_id, token_id(" " * 31), token_id(" " * 9)]


@slow
def test_double_space_between_words(tok, token_id):
    assert tok.encode("a  b") == [tok.bos_id, token_id("a"), token_id("  "), token_id("b")]
    assert tok.encode("a b") == [tok.bos_id, token_id("a"), token_id("\u2581b")]


@slow
@pytest.mark.parametrize("char", ["\n", "\t"])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 31])
def test_newline_and_tab_runs(tok, token_id, char, n):
    assert tok.encode(char * n, add_bos=False) == [token_id(char * n)]


@slow
def test_newline_run_inside_text(tok, token_id):
    ids = tok.encode("x\n\n\ny\t\tz", add_bos=False)
    assert ids == [
        token_id("x"),
        token_id("\n\n\n"),
        token_id("y"),
        token_id("\t\t"),
        token_id("z"),
    ]


@slow
@pytest.mark.parametrize(
    "text", [" x", "x ", "  hello world \n", "\t\n  mixed \t", "   ", " \n \n", "\n\n\n\n"]
)
def test_leading_and_trailing_whitespace_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_bos=False)) == text


# --- special tokens ------------------------------------------------------------------------


@slow
def test_control_tokens_only_with_parse_special(tok, token_id):
    text = "<start_of_turn>user\nHi<end_of_turn>"
    start, end = token_id("<start_of_turn>"), token_id("<end_of_turn>")
    parsed = tok.encode(text)
    assert parsed[:2] == [tok.bos_id, start]
    assert end in parsed
    plain = tok.encode(text, parse_special=False)
    assert start not in plain and end not in plain
    assert token_id("\n") in plain  # user-defined tokens still match
    assert tok.decode(plain) == "<bos>" + text
    assert tok.decode(parsed) == "<bos>" + text
    assert tok.decode(parsed, skip_special_tokens=True) == "user\nHi"
    assert tok.decode(plain, skip_special_tokens=True) == text  # written, not control tokens


@slow
def test_text_with_control_tokens_round_trips(tok):
    text = "<start_of_turn>user\n你好🤖<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, add_bos=False)
    assert ids[:3] == [105, 2364, 107]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\n你好🤖\nmodel\n"


@slow
def test_text_starting_with_bos_gives_double_bos(tok):
    assert tok.encode("<bos>hi")[:2] == [tok.bos_id, tok.bos_id]
    assert tok.encode("<bos>hi", parse_special=False).count(tok.bos_id) == 1


@slow
def test_user_defined_html_tag(tok, token_id):
    ids = tok.encode("<b>x</b>", add_bos=False, parse_special=False)
    assert ids == [token_id("<b>"), token_id("x"), token_id("</b>")]


@slow
def test_user_defined_end_marker_is_a_control_token_as_in_llamacpp(tok, token_id, metadata):
    # "</s>" is user-defined in this GGUF, but llama.cpp makes it a control token by its text
    # (model.tokenizer.vocab.llama_cpp_types). llama.cpp's ids for "a</s>b", from its
    # llama-tokenize (the llama.cpp vendored in llama-cpp-python 0.3.36; its commit is in
    # tests/data/spm-vocab-llamacpp.json) on this file:
    assert metadata["tokenizer.ggml.token_type"][token_id("</s>")] == 4
    assert tok.encode("a</s>b") == [2, 236746, 212, 236763]
    assert tok.encode("a</s>b", parse_special=False) == [2, 236746, 954, 236751, 236813, 236763]
    assert tok.decode([212]) == "</s>" and tok.decode([212], skip_special_tokens=True) == ""


# --- unicode -------------------------------------------------------------------------------


@slow
@pytest.mark.parametrize(
    "text",
    [
        "🎉🚀 party",
        "👩‍👩‍👧 family",
        "日本の首都は東京です。",
        "中文测试，汉字",
        "한국어 텍스트",
        "e\u0301 café",
    ],
)
def test_unicode_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_bos=False)) == text


@slow
def test_char_absent_from_vocab_uses_byte_tokens(tok, metadata):
    char = "\U00013000"  # EGYPTIAN HIEROGLYPH A001
    tokens = metadata["tokenizer.ggml.tokens"]
    assert char not in set(tokens)
    byte_ids = [tokens.index(f"<0x{b:02X}>") for b in char.encode("utf-8")]
    assert all(238 <= i <= 493 for i in byte_ids)
    assert tok.encode(char, add_bos=False) == byte_ids
    assert tok.decode(tok.encode(f"a{char}b", add_bos=False)) == f"a{char}b"


@slow
def test_piece_of_byte_and_control_tokens(tok, token_id):
    assert tok.piece(token_id("<0x41>")) == "A"
    assert tok.piece(token_id("<start_of_turn>")) == "<start_of_turn>"
    assert tok.piece(token_id("<0xE4>")) == "\ufffd"  # one byte of a 3-byte character
    assert tok.piece(token_id("\u2581Paris")) == " Paris"


@slow
def test_out_of_range_id_raises(tok):
    with pytest.raises(TokenizerError, match="262144"):
        tok.piece(tok.vocab_size)
    with pytest.raises(TokenizerError, match="-1"):
        tok.decode([5, -1])


# --- small synthetic vocabularies (no model file) ------------------------------------------


def _tiny_metadata(scores: dict[str, float], **extra) -> dict:
    """A llama-model vocab: <unk>, <s>, </s>, "▁", then `scores`' tokens; no space prefix,
    as Gemma 3's."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", *scores]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, *scores.values()],
        "tokenizer.ggml.token_type": [2, 3, 3, 1] + [1] * len(scores),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
        **extra,
    }


@pytest.mark.parametrize(
    ("ab", "bc", "expected"),
    [(-1.0, -2.0, ["ab", "c"]), (-2.0, -1.0, ["a", "bc"])],
)
def test_higher_scoring_merge_wins(ab, bc, expected):
    meta = _tiny_metadata({"a": -5.0, "b": -5.0, "c": -5.0, "ab": ab, "bc": bc})
    tokens = meta["tokenizer.ggml.tokens"]
    ids = Tokenizer.from_gguf_metadata(meta).encode("abc", add_bos=False)
    assert [tokens[i] for i in ids] == expected


def test_add_bos_follows_metadata():
    vocab = {"a": -1.0}
    assert Tokenizer.from_gguf_metadata(_tiny_metadata(vocab)).encode("a") == [1, 4]
    off = _tiny_metadata(vocab, **{"tokenizer.ggml.add_bos_token": False})
    assert Tokenizer.from_gguf_metadata(off).encode("a") == [4]
    assert Tokenizer.from_gguf_metadata(off).encode("a", add_bos=True) == [1, 4]


@pytest.mark.parametrize("model", ["bert", "t5", None])
def test_unsupported_model_raises(model):
    meta = _tiny_metadata({"a": -1.0}, **{"tokenizer.ggml.model": model})
    with pytest.raises(TokenizerError, match=repr(model)):
        Tokenizer.from_gguf_metadata(meta)


def test_gpt2_model_without_merges_raises():
    meta = _tiny_metadata({"a": -1.0}, **{"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(meta)


def test_missing_tokens_or_mismatched_arrays_raise():
    meta = _tiny_metadata({"a": -1.0})
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(meta)
    meta = _tiny_metadata({"a": -1.0})
    meta["tokenizer.ggml.token_type"] = [1]
    with pytest.raises(TokenizerError, match="differ in length"):
        Tokenizer.from_gguf_metadata(meta)


def test_bos_id_outside_vocab_raises():
    meta = _tiny_metadata({"a": -1.0}, **{"tokenizer.ggml.bos_token_id": 99})
    with pytest.raises(TokenizerError, match="bos_token_id"):
        Tokenizer.from_gguf_metadata(meta)
