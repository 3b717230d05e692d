"""`jobs.tokenizer.ServedTokenizer` rebuilt from a worker's published blob tokenizes exactly
like `model.tokenizer.Tokenizer`: every encode option on a varied corpus, every id's piece and
decode, random id sequences. For the tiny test vocabularies (SentencePiece gemma3-tiny, the
byte-level BPE of deepseek4-tiny and of tests/data's DeepSeek V3 vocab GGUF) and the real
Gemma 3 270M (slow). Malformed blobs raise the typed errors."""

from __future__ import annotations

import threading
import time
import zlib

import msgpack
import numpy as np
import pytest

from jobs import InvalidRequest, TokenizerMalformed, TokenizerUnavailable, TokenOutOfRange
from jobs.tokenizer import FORMAT, ServedTokenizer, pack_tokenizer
from model.gguf.reader import read_gguf
from model.tokenizer import Tokenizer, TokenizerError
from model.tokenizer.chat import builtin_template
from tests.model.test_tokenizer_gpt2 import CORPUS, VOCAB_GGUF

CONTROL_TEXTS = [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><bos>text<eos>", "<pad><unk><mask>", "a<eos>b", "<bos",
    "<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜>", "<｜User｜>q<｜Assistant｜><think>x</think>",
    "<｜tool▁calls▁begin｜><｜fim▁hole｜>", "<0x41><0xFF>", "[multimodal]",
]
TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t\t", " " * 40, "\n" * 33, "a  b   c    d",
    "Hello, world!", "The capital of France is", " leading", "trailing ", "  both  ",
    "café naïve résumé façade Ångström Zürich crème brûlée",
    "😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ 🚀", "深度求索的大语言模型。東京は日本の首都です。한국어 문장",
    "Русский текст, Ελληνικά, العربية, עברית", "▁literal▁underscore▁", "\x00\x01\x7f\u200b",
    "line one\r\nline two\rthree", "x = {i * 3.14159:.2f} # 1,234,567 $19.99",
    *CONTROL_TEXTS, *CORPUS.splitlines(keepends=True), CORPUS,
]
OPTIONS = [dict(add_bos=b, parse_special=p) for b in (None, True, False) for p in (True, False)]


def random_texts(tok: Tokenizer, n: int, seed: int) -> list[str]:
    """Texts of random vocabulary pieces, corpus slices and special tokens run together."""
    rng = np.random.default_rng(seed)
    words = [tok.piece(i) for i in range(tok.vocab_size)] + CONTROL_TEXTS + TEXTS
    return ["".join(words[j] for j in rng.integers(0, len(words), rng.integers(1, 30)))
            for _ in range(n)]


def served(tok: Tokenizer) -> ServedTokenizer:
    return ServedTokenizer.from_blob(pack_tokenizer(tok.published()))


def assert_same_encode(tok: Tokenizer, st: ServedTokenizer, texts: list[str]) -> None:
    for text in texts:
        for options in OPTIONS:
            assert st.encode(text, **options) == tok.encode(text, **options), (text, options)


def assert_same_decode(tok: Tokenizer, st: ServedTokenizer, seed: int, every_id=True) -> None:
    ids = range(tok.vocab_size)
    if every_id:
        assert [st.decode([i]) for i in ids] == [tok.decode([i]) for i in ids]
    assert [st.piece(i) for i in ids] == [tok.piece(i) for i in ids]
    rng = np.random.default_rng(seed)
    for _ in range(300):
        seq = rng.integers(0, tok.vocab_size, rng.integers(0, 40)).tolist()
        assert st.decode(seq) == tok.decode(seq), seq
        skipped = st.decode(seq, skip_special_tokens=True)
        assert skipped == tok.decode(seq, skip_special_tokens=True), seq
        assert "".join(st.pieces(seq)) == st.decode(seq), seq
    assert st.decode(list(ids)) == tok.decode(list(ids))
    for bad in (-1, tok.vocab_size):
        with pytest.raises(TokenizerError):
            tok.decode([0, bad])
        with pytest.raises(TokenOutOfRange, match=f"token id {bad} is outside"):
            st.decode([0, bad])
        with pytest.raises(TokenOutOfRange):
            st.piece(bad)
        with pytest.raises(TokenOutOfRange):
            st.pieces([0, bad])


def assert_same_fields(tok: Tokenizer, st: ServedTokenizer, tokens: list[str]) -> None:
    assert (st.vocab_size, st.bos_id, st.eos_id, st.pad_id, st.add_bos) == (
        tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok._add_bos)
    for name in ("bos", "eos", "pad"):
        i = getattr(tok, f"{name}_id")
        assert getattr(st, f"{name}_token") == (None if i is None else tokens[i])
    template = tok.chat_template
    assert st.chat_template == (None if template is None else template.source)
    if st.bos_token is not None:  # lm-eval's RemoteTokenizer finds the id this way
        assert st.encode(st.bos_token, add_bos=False) == [st.bos_id]


def metadata_of(path) -> dict:
    return read_gguf(path).metadata


@pytest.fixture(scope="module", params=["gemma3-tiny", "deepseek4-tiny", "gpt2-vocab"])
def vocab(request):
    """(metadata, tokenizer) of a tiny vocabulary; gemma3-tiny gets the Gemma 3 template."""
    from model.registry import resolve

    if request.param == "gpt2-vocab":
        metadata = metadata_of(VOCAB_GGUF)
        return metadata, Tokenizer.from_gguf_metadata(metadata)
    metadata = metadata_of(resolve(request.param)[1])
    template = builtin_template("gemma3") if request.param == "gemma3-tiny" else None
    return metadata, Tokenizer.from_gguf_metadata(metadata, default_chat_template=template)


def test_tiny_vocabularies_tokenize_alike(vocab):
    metadata, tok = vocab
    st = served(tok)
    assert_same_fields(tok, st, metadata["tokenizer.ggml.tokens"])
    assert_same_encode(tok, st, TEXTS + random_texts(tok, 300, seed=1))
    assert_same_decode(tok, st, seed=2)
    assert (tok._piece_bytes is None) == (metadata["tokenizer.ggml.model"] == "llama")


def test_pad_token_and_template_come_through(vocab):
    metadata, tok = vocab
    st = served(tok)
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    assert st.pad_id == pad and tok.pad_id == pad
    info = st.info(model_max_length=4096)
    assert {k: info[k] for k in ("eos_token", "bos_token", "pad_token", "chat_template")} == {
        "eos_token": st.eos_token, "bos_token": st.bos_token, "pad_token": st.pad_token,
        "chat_template": st.chat_template}
    assert info["model_max_length"] == 4096 and "model_max_length" not in st.info()
    assert (info["vocab_size"], info["eos_token_id"]) == (tok.vocab_size, tok.eos_id)


def test_numpy_ids_decode_and_non_integers_are_refused(vocab):
    _, tok = vocab
    st = served(tok)
    ids = np.arange(min(50, tok.vocab_size))
    assert st.decode(ids) == tok.decode(ids.tolist())
    assert st.piece(np.int64(5)) == tok.piece(5)
    with pytest.raises(InvalidRequest, match="integers"):
        st.decode([1.5])
    with pytest.raises(InvalidRequest):
        st.decode(["3"])


def test_a_lone_surrogate_is_an_invalid_request(vocab):
    st = served(vocab[1])
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        st.encode("a\udc00b")  # the tokenizers binding raised a bare TypeError


class YieldingAfterSet:
    """A `tokenizers` object that lets other threads run right after a setting changes, so
    an encode whose special-token toggle is not guarded would see another thread's."""

    def __init__(self, hf):
        object.__setattr__(self, "_hf", hf)

    def __getattr__(self, name):
        return getattr(self._hf, name)

    def __setattr__(self, name, value):
        setattr(self._hf, name, value)
        time.sleep(0)


def test_concurrent_encodes_keep_their_own_parse_special(vocab):
    _, tok = vocab
    st = served(tok)
    st._hf = YieldingAfterSet(st._hf)
    text = "<bos>a<eos> " + CONTROL_TEXTS[0] + CONTROL_TEXTS[5]
    expected = {p: tok.encode(text, parse_special=p) for p in (True, False)}
    assert expected[True] != expected[False]
    wrong = []

    def run(parse_special: bool) -> None:
        for _ in range(300):
            if st.encode(text, parse_special=parse_special) != expected[parse_special]:
                wrong.append(parse_special)

    threads = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.slow
def test_gemma3_270m_tokenizes_alike(gemma, reference_cases):
    tok = gemma.tokenizer
    st = served(tok)
    assert tok.chat_template is not None  # the built-in template is published too
    metadata = metadata_of(gemma.path)
    assert_same_fields(tok, st, metadata["tokenizer.ggml.tokens"])
    texts = TEXTS + [c["text"] for c in reference_cases] + random_texts(tok, 200, seed=3)
    assert_same_encode(tok, st, texts)
    assert [st.encode(c["text"]) for c in reference_cases] == [
        c["tokens"] for c in reference_cases]
    assert_same_decode(tok, st, seed=4, every_id=False)  # piece is decode of one id


# --- malformed blobs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fields(vocab):
    return vocab[1].published()


DELETE = object()


def repack(fields: dict, **changes) -> bytes:
    """A blob of `fields` with top-level entries replaced (`DELETE`: removed)."""
    data = msgpack.unpackb(pack_tokenizer(fields))
    data.update(changes)
    return msgpack.packb({k: v for k, v in data.items() if v is not DELETE}, use_bin_type=True)


@pytest.mark.parametrize("change, message", [
    (dict(format=DELETE), "format"),
    (dict(format="1"), "format"),
    (dict(vocab_size=DELETE), "'vocab_size' is missing"),
    (dict(vocab_size=True), "'vocab_size' has type bool"),
    (dict(vocab_size=0), "not positive"),
    (dict(add_bos=1), "'add_bos' has type int"),
    (dict(bos_id=10**6), "bos_id 1000000 is outside"),
    (dict(eos_id=-1), "eos_id -1 is outside"),
    (dict(chat_template=7), "'chat_template'"),
    (dict(piece_bytes=[b"a"]), "piece_bytes"),
    (dict(piece_bytes="abc"), "piece_bytes"),
    (dict(tokenizer_json_zlib=DELETE), "tokenizer_json_zlib"),
    (dict(tokenizer_json_zlib=b"not zlib"), "does not inflate"),
    (dict(tokenizer_json_zlib=zlib.compress(b"{}")), "does not load"),
    (dict(tokenizer_json_zlib=zlib.compress(b"\xff\xfe")), "not UTF-8"),
])
def test_malformed_fields_raise_typed_error(fields, change, message):
    with pytest.raises(TokenizerMalformed, match=message):
        ServedTokenizer.from_blob(repack(fields, **change))


def test_undecodable_blobs_raise_typed_error(fields):
    blob = pack_tokenizer(fields)
    for bad in (b"", b"\xc1", blob[: len(blob) // 2], msgpack.packb([1, 2]), b"garbage" * 9):
        with pytest.raises(TokenizerMalformed):
            ServedTokenizer.from_blob(bad)
    truncated = zlib.compress(fields["tokenizer_json"].encode())[:-20]
    with pytest.raises(TokenizerMalformed, match="truncated"):
        ServedTokenizer.from_blob(repack(fields, tokenizer_json_zlib=truncated))


def test_newer_format_is_unavailable_not_malformed(fields):
    with pytest.raises(TokenizerUnavailable, match="upgrade prefillq") as caught:
        ServedTokenizer.from_blob(repack(fields, format=FORMAT + 1))
    assert type(caught.value) is TokenizerUnavailable


def test_pack_refuses_incomplete_fields(fields):
    with pytest.raises(TokenizerMalformed, match="'tokenizer_json'"):
        pack_tokenizer({k: v for k, v in fields.items() if k != "tokenizer_json"})
    with pytest.raises(TokenizerMalformed, match="'eos_token' is missing"):
        pack_tokenizer({k: v for k, v in fields.items() if k != "eos_token"})
