"""model.tokenizer's "llama" (SentencePiece) path on a Llama-2/Mistral-style vocabulary,
against llama.cpp's token ids.

tests/data/spm-vocab-llama2.gguf (`build_vocab_gguf`) is a vocab-only GGUF in Llama 2's
layout; tests/data/spm-vocab-llamacpp.json holds the ids llama.cpp's ``llama-tokenize`` gave
for it, with ``add_space_prefix`` absent, ``true`` and ``false`` (`regenerate` rewrites both).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

from model.tokenizer import Tokenizer
from tests.model.llamacpp_tokenize import read_reference, run_llama_tokenize, write_reference
from tests.model.test_tokenizer_gpt2 import CORPUS

DATA = Path(__file__).parents[1] / "data"
VOCAB_GGUF = DATA / "spm-vocab-llama2.gguf"
REFERENCE_JSON = DATA / "spm-vocab-llamacpp.json"

N_MERGES = 500
CONTROL = ("[INST]", "[/INST]")
USER_DEFINED = "<|tool|>"
# Typed normal, user-defined and normal in the GGUF; llama.cpp makes them control tokens by
# their text (end-of-generation and fill-in-the-middle markers, model.tokenizer.vocab).
RETYPED = (("<|im_end|>", 1), ("<|endoftext|>", 4), ("<fim_prefix>", 1))
# tokenizer.ggml.add_space_prefix values the reference covers (None: the key is absent)
SPACE_PREFIXES = (None, True, False)

TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "",
    " ",
    "   ",
    "trailing spaces   ",
    "a  b   c",
    "line one\nline two\n\n  indented\r\n",
    "\n\n",
    "\ttab\tseparated",
    "Numbers 1234567 and 3.14159",
    "don't won't it's",
    "Punctuation...!?;:—–-_~`@#$%^&*()[]{}<>/\\|\"'",
    "def f(x):\n    return x ** 2  # square\n",
    "café naïve résumé Ångström crème brûlée",
    "深度求索 日本語のテキスト 한국어",
    "Emoji 😀👍🏽 rocket🚀 ⅻ",
    "a literal ▁ mark and ▁▁ two",
    "[INST] What is 2+2? [/INST] 4</s>",
    "<s>[INST]Hi[/INST]Hello</s><s>[INST] again [/INST]",
    "tool call <|tool|> with {\"x\": 1} after",
    "<|tool|>",
    "[INST]",
    "<s> lookalikes: [INST ] <unk> [/inst]",
    "reply<|im_end|>\n<|endoftext|> and <fim_prefix>x",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
# Cases also run without special-token parsing (llama-tokenize ``--no-parse-special``).
NO_SPECIAL_TEXTS = [TEXTS[19], TEXTS[20], TEXTS[21], TEXTS[25]]
COMMAND = (
    "llama-tokenize -m spm-vocab-llama2.gguf -f <text file> --ids --log-disable --no-escape "
    "[--no-parse-special] (vocab_only; BOS per tokenizer.ggml.add_bos_token = true); the "
    "add_space_prefix true/false cases ran on the same GGUF with that key added"
)


def _learned_pieces() -> list[str]:
    """BpeTrainer's pieces on the corpus (``▁`` for spaces, words split), in merge order."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=10_000, limit_alphabet=1000, show_progress=False)
    hf.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    data = json.loads(hf.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in data["merges"][:N_MERGES]]
    alphabet = sorted((t for t in data["vocab"] if len(t) == 1), key=data["vocab"].get)
    merged = list(dict.fromkeys(a + b for a, b in merges))
    return merged + [c for c in alphabet if c not in merged]


def vocab_arrays() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the test vocabulary, in Llama 2's order."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = _learned_pieces()
    tokens += pieces
    types += [1] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]  # SentencePiece BPE: earlier is better
    tokens += [*CONTROL, USER_DEFINED, *(t for t, _ in RETYPED)]
    types += [3] * len(CONTROL) + [4] + [ty for _, ty in RETYPED]
    scores += [0.0] * (len(CONTROL) + 1 + len(RETYPED))
    return tokens, scores, types


def build_vocab_gguf(path: Path, space_prefix: bool | None = None) -> None:
    """Writes the vocab-only Llama-2-style GGUF (same bytes every time): ``<unk>``,
    ``<s>``, ``</s>``, the 256 byte tokens, pieces learned by `tokenizers`' BpeTrainer on
    the corpus of tests/model/test_tokenizer_gpt2.py (scored by merge order, as
    SentencePiece's BPE scores them), Mistral's ``[INST]``/``[/INST]`` control tokens, one
    user-defined token and three that llama.cpp re-types as control tokens."""
    from gguf import GGUFWriter

    from model.gguf.synthetic.common import finish

    tokens, scores, types = vocab_arrays()
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("prefillq spm vocab test")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if space_prefix is not None:
        writer.add_add_space_prefix(space_prefix)
    finish(writer, path)


def regenerate(binary: str, source: str) -> None:
    """Rewrites the GGUF and JSON fixtures from ``llama-tokenize`` at `binary`:
    ``python -m tests.model.test_tokenizer_spm /path/to/llama-tokenize "<commit, build>"``.

    Args:
        binary: path of a built ``llama-tokenize``.
        source: where that llama.cpp came from (full commit, how it was built), for the record.
    """
    build_vocab_gguf(VOCAB_GGUF)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for prefix in SPACE_PREFIXES:
            gguf = VOCAB_GGUF if prefix is None else Path(tmp) / f"{prefix}.gguf"
            build_vocab_gguf(gguf, prefix)
            runs = [(t, True) for t in TEXTS] + [(t, False) for t in NO_SPECIAL_TEXTS]
            cases += [{"add_space_prefix": prefix, "text": t, "parse_special": special,
                       "tokens": run_llama_tokenize(binary, gguf, t, parse_special=special)}
                      for t, special in runs]
    write_reference(REFERENCE_JSON, gguf=VOCAB_GGUF, binary=binary, source=source,
                    command=COMMAND, cases=cases)


if __name__ == "__main__":
    regenerate(sys.argv[1], sys.argv[2])


# --- tests -----------------------------------------------------------------------------------

REFERENCE = read_reference(REFERENCE_JSON)
CASES = REFERENCE["cases"] if REFERENCE else []
CASE_IDS = [
    f"prefix={c['add_space_prefix']}:{i}:{c['text'][:20]!r}"
    f"{'' if c['parse_special'] else ':no-special'}"
    for i, c in enumerate(CASES)
]


@pytest.fixture(scope="module")
def metadata() -> dict:
    from model.gguf.reader import read_gguf

    return read_gguf(VOCAB_GGUF).metadata


@pytest.fixture(scope="module")
def tok_for(metadata):
    built = {}

    def get(prefix: bool | None) -> Tokenizer:
        if prefix not in built:
            md = dict(metadata)
            if prefix is not None:
                md["tokenizer.ggml.add_space_prefix"] = prefix
            built[prefix] = Tokenizer.from_gguf_metadata(md)
        return built[prefix]

    return get


def test_reference_covers_the_text_list():
    for prefix in SPACE_PREFIXES:
        rows = [c for c in CASES if c["add_space_prefix"] == prefix]
        assert [c["text"] for c in rows if c["parse_special"]] == TEXTS
        assert [c["text"] for c in rows if not c["parse_special"]] == NO_SPECIAL_TEXTS


def test_vocab_gguf_is_the_one_llamacpp_saw(tmp_path):
    shipped = hashlib.sha256(VOCAB_GGUF.read_bytes()).hexdigest()
    assert shipped == REFERENCE["meta"]["gguf_sha256"]
    build_vocab_gguf(tmp_path / "rebuilt.gguf")
    assert hashlib.sha256((tmp_path / "rebuilt.gguf").read_bytes()).hexdigest() == shipped


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_encode_matches_llamacpp(tok_for, case):
    tok = tok_for(case["add_space_prefix"])
    assert tok.encode(case["text"], parse_special=case["parse_special"]) == case["tokens"]


def test_the_space_prefix_is_on_by_default_and_after_special_tokens(tok_for, metadata):
    """Gemma 3's GGUF turns llama.cpp's space prefix off (``tokenizer.ggml.add_space_prefix =
    false``); Llama 2 and Mistral vocabularies leave it on, the default when the key is absent:
    llama.cpp (``llama_vocab::impl::tokenize``, ``LLAMA_VOCAB_TYPE_SPM``) prepends a space to
    every text fragment (the start, and text after a control or user-defined token), then
    spells spaces ``▁`` and merges by score, spelling what no token covers in byte tokens.
    """
    ids = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    on, off = tok_for(None), tok_for(False)
    assert on.encode("Hello", add_bos=False) == tok_for(True).encode("Hello", add_bos=False)
    assert on.encode("Hello", add_bos=False)[0] == ids["▁Hello"]
    assert off.encode("Hello", add_bos=False)[0] != ids["▁Hello"]
    inst = on.encode("[INST]Hello", add_bos=False)
    assert inst[:2] == [ids["[INST]"], ids["▁Hello"]]
    assert on.encode("", add_bos=False) == [] and on.encode("") == [1]


def test_text_outside_the_vocabulary_falls_back_to_bytes(tok_for, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = tok_for(None).encode("🦙", add_bos=False)
    assert [tokens[i] for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok_for(None).decode(ids) == " 🦙"  # decode keeps the prefix llama.cpp added


def test_markers_llama_cpp_retypes_are_control_tokens(tok_for, metadata):
    ids = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    tok = tok_for(None)
    for text, _ in RETYPED:
        assert tok.encode(text, add_bos=False) == [ids[text]]
        assert ids[text] not in tok.encode(text, add_bos=False, parse_special=False)
        # llama.cpp's token_to_piece(special=False) of a control token is empty
        assert tok.decode([ids[text]], skip_special_tokens=True) == ""
