"""model.tokenizer's "gpt2" (byte-level BPE) path against llama.cpp's token ids.

tests/data/gpt2-vocab-deepseek3.gguf (`build_vocab_gguf`) is a vocab-only GGUF in DeepSeek's
format; tests/data/gpt2-vocab-llamacpp.json holds the ids llama.cpp's ``llama-tokenize`` gave
for it, so these tests need no llama.cpp (`regenerate` rewrites both).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

from model.tokenizer import GPT2_PRE_TOKENIZERS, Tokenizer, TokenizerError
from tests.model.llamacpp_tokenize import read_reference, run_llama_tokenize, write_reference

DATA = Path(__file__).parents[1] / "data"
VOCAB_GGUF = DATA / "gpt2-vocab-deepseek3.gguf"
REFERENCE_JSON = DATA / "gpt2-vocab-llamacpp.json"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
CONTROL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2, as in DeepSeek V3
# Added after the merges, as in DeepSeek's tokenizer.json.
EXTRA_CONTROL_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜fim▁hole｜>")
USER_DEFINED_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
N_MERGES = 600

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog didn't care; it's a lazy dog.
Hello, world! Hello again, world. How are you doing today? I'm fine, thanks — and you?
We've been there, they'll go there, she'd said it and you're right: it's theirs.
In 2024 the company shipped 1,234,567 units at $19.99 each, up 12.5% from 2023.
Call +1 (555) 123-4567 or email info@example.com before 10:30 a.m. on 2024-06-01.
def tokenize(text: str) -> list[int]:
    \"\"\"Split text into tokens.\"\"\"
    return [ord(c) for c in text if c.isprintable()]

for i in range(10):
    print(f"value = {i * 3.14159:.2f}")  # comment
if (x >= 0 && y <= 100) { return x + y; } else { return -1; }
<div class="note">HTML &amp; XML tags</div> <br/> [link](https://example.org/path?q=1)
The the THE tHe. Tokenization, tokenizer, tokenizers, tokenized, retokenize.
深度求索的大语言模型使用字节级的分词器。我们今天学习中文，明天学习日语。
人工智能正在改变世界，中国的研究人员发布了新的模型。
日本語のテキストもあります。ひらがなとカタカナ、そして漢字を使います。
東京は日本の首都です。カタカナのコンピューターとインターネット。
한국어 문장도 있습니다. 안녕하세요, 세계!
Русский текст: привет, мир! Как дела? Всё хорошо.
Ελληνικά: γειά σου κόσμε. العربية: مرحبا بالعالم. עברית: שלום עולם.
Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ 🚀 — and symbols: © ® ™ € £ ¥ ° ± × ÷ ∞ ≤ ≥ ≠ √ ∑.
Accents: café naïve résumé façade Ångström Zürich São Paulo crème brûlée.
Whitespace:   three spaces,\ttab,\t\ttwo tabs, trailing spaces\x20\x20\x20
New
lines


and blank lines.
Numbers: 0 1 12 123 1234 12345 123456 1234567 3.14159 2.71828 1e10 0x1F 007.
"""


def _train_merges() -> list[tuple[str, str]]:
    """BPE merges learned on `CORPUS` with DeepSeek V3's pre-tokenizer (deterministic)."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(
                pre_tokenizers.Split(Regex(r), behavior="isolated")
                for r in GPT2_PRE_TOKENIZERS["deepseek-v3"]
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    data = json.loads(hf.to_str())
    return [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]
    ]


def _byte_alphabet() -> list[str]:
    """GPT-2's 256 byte characters, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    by_byte = dict(zip(bs, cs, strict=True))
    return [chr(by_byte[b]) for b in range(256)]


def vocab_arrays() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the test vocabulary."""
    merges = _train_merges()
    tokens = [*CONTROL_TOKENS, *_byte_alphabet()]
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            tokens.append(a + b)
            seen.add(a + b)
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    tokens += [*EXTRA_CONTROL_TOKENS, *USER_DEFINED_TOKENS]
    types += [3] * len(EXTRA_CONTROL_TOKENS) + [4] * len(USER_DEFINED_TOKENS)
    return tokens, types, [f"{a} {b}" for a, b in merges]


def build_vocab_gguf(path: Path, pre: str = "deepseek-v3") -> None:
    """Writes the vocab-only DeepSeek-style GGUF (same bytes every time), with `pre`: no
    DeepSeek GGUF is at hand, so ``tokenizer.ggml.model = "gpt2"``, the 256 GPT-2 byte
    tokens plus merges learned by `tokenizers`' BpeTrainer on `CORPUS` (split with DeepSeek
    V3's pre-tokenizer regexes), DeepSeek's control tokens and a few user-defined ones."""
    from gguf import GGUFWriter

    tokens, types, merges = vocab_arrays()
    writer = GGUFWriter(str(path), "deepseek2")
    writer.add_name("prefillq gpt2 vocab test")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Strings llama.cpp tokenized for the reference (kept here so regeneration uses the same list).
TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you?",
    "",
    " ",
    "  ",
    "   leading and trailing   ",
    "a  b   c    d",
    "\t\ttabs\tand spaces \t mixed",
    "line one\nline two\n\nline four\r\nwindows\r\n",
    "\n\n\n",
    "1234567",
    "12345678901234567890",
    "pi is 3.14159, e is 2.71828; 1,000,000 and 10.5%",
    "0x1F 007 1e10 -42 +7",
    "don't won't it's I'm we've they'll she'd DON'T IT'S",
    "(x >= 0 && y <= 100) { return x + y; } // done!!!",
    "Punctuation...!?;:—–-_~`@#$%^&*()[]{}<>/\\|\"'",
    "def f(x):\n    return x ** 2  # square\n",
    "深度求索的大语言模型使用字节级的分词器。",
    "日本語のテキスト、ひらがなとカタカナ。東京タワー！",
    "한국어 문장: 안녕하세요, 세계!",
    "Привет, мир! Ελληνικά και العربية",
    "café naïve résumé Ångström crème brûlée",
    "Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ rocket🚀",
    "mixed中文English日本語123abc한국어",
    "Zero\u200bwidth\u00a0nbsp\u3000ideographic space\u2028sep",
    f"{BOS}Hello{EOS}",
    f"<｜User｜>What is 2+2?<｜Assistant｜><think>\nfour\n</think>\n\n4{EOS}",
    f"text with {PAD} and <｜tool▁calls▁begin｜> and <｜fim▁hole｜> inside",
    "<｜begin of sentence｜> lookalike, <think > not a tag",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "ǅungla Ǆ ǆ ﬁne ﬀ ½ ² ³ Ⅻ ⑩ 𝟘𝟙 ١٢٣",
    "Tokenization tokenizer tokenizers tokenized retokenize THE the The",
]
# Cases also run without special-token parsing (``--no-parse-special``).
NO_SPECIAL_TEXTS = [TEXTS[27], TEXTS[28], TEXTS[29]]
# The other pre-tokenizers, checked on the same vocabulary with only tokenizer.ggml.pre changed.
OTHER_PRES = ["default", "gpt-2", "llama-bpe", "qwen2", "smollm"]
COMMAND = (
    "llama-tokenize -m gpt2-vocab-deepseek3.gguf -f <text file> --ids --log-disable --no-escape "
    "[--no-parse-special] (vocab_only; BOS per tokenizer.ggml.add_bos_token = true); cases with "
    "another 'pre' ran on the same GGUF rebuilt with that tokenizer.ggml.pre"
)


def regenerate(binary: str, source: str) -> None:
    """Rewrites the GGUF and JSON fixtures from ``llama-tokenize`` at `binary`:
    ``python -m tests.model.test_tokenizer_gpt2 /path/to/llama-tokenize "<commit, build>"``.

    Args:
        binary: path of a built ``llama-tokenize``.
        source: where that llama.cpp came from (full commit, how it was built), for the record.
    """
    build_vocab_gguf(VOCAB_GGUF)

    def case(gguf: Path, pre: str, text: str, parse_special: bool) -> dict:
        ids = run_llama_tokenize(binary, gguf, text, parse_special=parse_special)
        return {"pre": pre, "text": text, "parse_special": parse_special, "tokens": ids}

    cases = [case(VOCAB_GGUF, "deepseek-v3", t, True) for t in TEXTS]
    cases += [case(VOCAB_GGUF, "deepseek-v3", t, False) for t in NO_SPECIAL_TEXTS]
    with tempfile.TemporaryDirectory() as tmp:
        for pre in OTHER_PRES:
            build_vocab_gguf(Path(tmp) / f"{pre}.gguf", pre)
            cases += [case(Path(tmp) / f"{pre}.gguf", pre, t, True) for t in TEXTS]
    write_reference(REFERENCE_JSON, gguf=VOCAB_GGUF, binary=binary, source=source,
                    command=COMMAND, cases=cases)


if __name__ == "__main__":
    regenerate(sys.argv[1], sys.argv[2])


# --- tests -----------------------------------------------------------------------------------

REFERENCE = read_reference(REFERENCE_JSON)
CASES = REFERENCE["cases"] if REFERENCE else []
CASE_IDS = [
    f"{c['pre']}:{i}:{c['text'][:24]!r}{'' if c['parse_special'] else ':no-special'}"
    for i, c in enumerate(CASES)
]


def _metadata(path: Path) -> dict:
    from model.gguf.reader import read_gguf

    return read_gguf(path).metadata


@pytest.fixture(scope="module")
def metadata() -> dict:
    return _metadata(VOCAB_GGUF)


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


def _with(metadata: dict, **changes) -> dict:
    md = dict(metadata)
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


# --- llama.cpp reference ---------------------------------------------------------------------


def test_reference_covers_the_text_list():
    deepseek = [c for c in CASES if c["pre"] == "deepseek-v3"]
    assert [c["text"] for c in deepseek if c["parse_special"]] == TEXTS
    assert [c["text"] for c in deepseek if not c["parse_special"]] == NO_SPECIAL_TEXTS
    for pre in OTHER_PRES:
        assert [c["text"] for c in CASES if c["pre"] == pre] == TEXTS


def test_vocab_gguf_is_the_one_llamacpp_saw(tmp_path):
    shipped = hashlib.sha256(VOCAB_GGUF.read_bytes()).hexdigest()
    assert shipped == REFERENCE["meta"]["gguf_sha256"]
    build_vocab_gguf(tmp_path / "rebuilt.gguf")
    assert hashlib.sha256((tmp_path / "rebuilt.gguf").read_bytes()).hexdigest() == shipped


@pytest.fixture(scope="module")
def tok_for_pre(metadata):
    built = {}

    def get(pre: str) -> Tokenizer:
        if pre not in built:
            built[pre] = Tokenizer.from_gguf_metadata(_with(metadata, pre=pre))
        return built[pre]

    return get


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_encode_matches_llamacpp(tok_for_pre, case):
    tok = tok_for_pre(case["pre"])
    assert tok.encode(case["text"], parse_special=case["parse_special"]) == case["tokens"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_of_llamacpp_ids_gives_the_text_and_its_bos(tok_for_pre, case):
    # llama.cpp's detokenize(special=True): a control token's piece is its text
    assert tok_for_pre(case["pre"]).decode(case["tokens"]) == BOS + case["text"]


def test_reference_exercises_merges_digits_and_specials(tok, metadata):
    by_text = {
        (c["text"], c["parse_special"]): c["tokens"] for c in CASES if c["pre"] == "deepseek-v3"
    }
    tokens = metadata["tokenizer.ggml.tokens"]
    # DeepSeek V3 splits digit runs into groups of up to 3, left to right.
    assert [tokens[i] for i in by_text[("1234567", True)][1:]] == ["123", "456", "7"]
    # Multi-character (merged) tokens occur.
    assert any(len(tokens[i]) > 1 for i in by_text[("Hello world", True)][1:])
    # Control tokens in text are matched only with special parsing.
    assert by_text[(TEXTS[27], True)] == [0, 0, *tok.encode("Hello", add_bos=False), 1]
    assert 1 not in by_text[(TEXTS[27], False)][1:]


# --- vocabulary facts ------------------------------------------------------------------------


def test_ids_and_size(tok, metadata):
    assert tok.vocab_size == len(metadata["tokenizer.ggml.tokens"])
    assert tok.bos_id == 0
    assert tok.eos_id == 1


def test_add_bos(tok, metadata):
    hello = tok.encode("Hello", add_bos=False)
    assert tok.encode("Hello") == [0, *hello]
    assert tok.encode("", add_bos=False) == []
    assert Tokenizer.from_gguf_metadata(_with(metadata, add_bos_token=False)).encode("Hi")[0] != 0
    # Without the key llama.cpp adds no BOS for BPE vocabularies, except Llama 3's.
    no_key = _with(metadata, add_bos_token=None)
    assert Tokenizer.from_gguf_metadata(no_key).encode("Hello") == hello
    llama3 = _with(no_key, pre="llama-bpe")
    assert Tokenizer.from_gguf_metadata(llama3).encode("Hello")[0] == 0


def test_user_defined_tokens_match_without_special_parsing(tok, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    user = tokens.index("<｜User｜>")
    think = tokens.index("<think>")
    assert tok.encode("<｜User｜>hi<think>", add_bos=False, parse_special=False)[0] == user
    assert think in tok.encode("<｜User｜>hi<think>", add_bos=False, parse_special=False)
    assert tok.encode(EOS, add_bos=False) == [1]
    assert 1 not in tok.encode(EOS, add_bos=False, parse_special=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_decode_and_piece(tok, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = tok.encode(f"{BOS}Hi{EOS}", add_bos=False)
    assert tok.decode(ids) == f"{BOS}Hi{EOS}"
    assert tok.decode(ids, skip_special_tokens=True) == "Hi"
    assert tok.piece(0) == BOS
    assert tok.piece(tokens.index("Ġ")) == " "
    assert tok.piece(tokens.index("Ċ")) == "\n"
    assert tok.piece(tokens.index("<think>")) == "<think>"
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([tok.vocab_size])


# --- pre-tokenizer kinds ---------------------------------------------------------------------


def _pieces(metadata: dict, pre: str, text: str) -> list[str]:
    tok = Tokenizer.from_gguf_metadata(_with(metadata, pre=pre))
    return [tok.piece(i) for i in tok.encode(text, add_bos=False)]


@pytest.mark.parametrize(
    ("pre", "digits"),
    [
        ("deepseek-v3", ["123", "456", "7"]),
        ("llama3", ["123", "456", "7"]),
        ("llama-bpe", ["123", "456", "7"]),
        ("qwen2", ["1", "2", "3", "4", "5", "6", "7"]),
        ("smollm", ["1", "2", "3", "4", "5", "6", "7"]),
        ("default", ["123", "456", "7"]),
    ],
)
def test_pre_kinds_split_digits(metadata, pre, digits):
    assert _pieces(metadata, pre, "1234567") == digits


@pytest.mark.parametrize(
    ("alias", "pre"),
    [("gpt2", "gpt-2"), ("llama3", "llama-bpe"), ("llama-v3", "llama-bpe"),
     ("deepseek-r1-qwen", "qwen2")],
)  # fmt: skip
def test_pre_aliases(tok_for_pre, alias, pre):
    for text in TEXTS:
        assert tok_for_pre(alias).encode(text) == tok_for_pre(pre).encode(text)


def test_empty_pre_is_default(metadata):
    tok_default = Tokenizer.from_gguf_metadata(_with(metadata, pre="default"))
    tok_missing = Tokenizer.from_gguf_metadata(_with(metadata, pre=None))
    text = "Numbers 12345, words; 中文!"
    assert tok_missing.encode(text) == tok_default.encode(text)


def test_unknown_pre_is_named(metadata):
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata(_with(metadata, pre="no-such-pre"))


def test_missing_merges(metadata):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(_with(metadata, merges=None))


def test_unknown_model_still_rejected(metadata):
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata(_with(metadata, model="bert"))


# --- the synthetic DeepSeek-V4 model ---------------------------------------------------------


def test_tiny_deepseek4_vocab_tokenizes(tmp_path):
    from model.gguf.synthetic import write_tiny_deepseek4

    path = tmp_path / "tiny-deepseek4.gguf"
    write_tiny_deepseek4(path)
    md = _metadata(path)
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.pre"] == "deepseek-v3"
    tok = Tokenizer.from_gguf_metadata(md)
    tokens = md["tokenizer.ggml.tokens"]
    assert tok.encode(" the", add_bos=False) == [tokens.index("Ġthe")]
    assert tok.encode("x")[0] == tok.bos_id
    for text in ["Hello world", "1234567 深度求索 😀", "", "a\n\n b  c"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == tokens[tok.bos_id] + text
