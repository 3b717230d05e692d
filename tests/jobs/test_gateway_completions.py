"""`jobs.gateway.completions`'s pure pieces: the echoed tokens spell the choice's text at their
offsets, the BOS the client did not send is context and not echoed, and ``--score-with-bos``
puts one before token ids only where it is missing. On the tiny Gemma 3's real published
tokenizer (its small vocabulary spells most characters in byte-fallback tokens) and the real
Gemma 3's; the results are made here, with a logprob for every position."""

from __future__ import annotations

import pytest

from jobs.gateway.completions import CompletionRequest, Scored, choice, with_bos
from jobs.result import PrefillResult, TopLogit
from jobs.tokenizer import ServedTokenizer, pack_tokenizer

TEXTS = ["The capital of France is Paris.", "a 𓀀𓀁 b ", "Héllo ✓ 日本 🤗\n\n  x",
         "€" * 300, "<bos>twice", ""]
ISSUE_TEXT = "<start_of_turn>user\n你好🤖<end_of_turn>\n<start_of_turn>model\n"


def served(loaded) -> ServedTokenizer:
    return ServedTokenizer.from_blob(pack_tokenizer(loaded.tokenizer.published()))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny) -> ServedTokenizer:
    """The tiny Gemma 3's published tokenizer, built once for this module."""
    return served(tiny)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma) -> ServedTokenizer:
    """The real Gemma 3's published tokenizer (~1 s to build), built once for this module."""
    return served(gemma)


def scored(client_input: dict, job_ids: list[int], generated: int) -> Scored:
    """A finished job over `job_ids`: position i's logprob is ``-i`` (none at 0)."""
    entries = [{"token": t, "logprob": None if i == 0 else -float(i),
                "top": [] if i == 0 else [{"id": t, "logprob": -float(i)}]}
               for i, t in enumerate(job_ids)]
    entries.append({"token": None, "logprob": None, "top": [{"id": generated, "logprob": -0.5}]})
    top = TopLogit(id=generated, logit=1.0, logprob=-0.5, piece="")
    result = PrefillResult(job_id="j", n_tokens=len(job_ids), cached_tokens=0, reuse="cold",
                           chunks_done=1, top_k=[top], timings={}, model_sha256="0",
                           prompt_logprobs=entries)
    return Scored(client_input, result)


def echoed(tokenizer: ServedTokenizer, job: Scored, max_tokens: int) -> dict:
    req = CompletionRequest(prompt="unused", echo=True, logprobs=1, max_tokens=max_tokens)
    return choice(0, job, req, tokenizer)


def assert_spelled(c: dict) -> None:
    """Every token's text is found at its offset in the choice's text, end to end."""
    text, lp = c["text"], c["logprobs"]
    assert "".join(lp["tokens"]) == text
    for piece, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset:offset + len(piece)] == piece, (text, piece, offset)


def check_text_prompt(tokenizer: ServedTokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_bos=False)
    job = scored({"prompt": text}, [tokenizer.bos_id, *ids], generated=ids[0] if ids else 5)
    for max_tokens in (0, 1):
        c = echoed(tokenizer, job, max_tokens)
        assert_spelled(c)
        lp = c["logprobs"]
        assert c["text"].startswith(text) and len(lp["tokens"]) == len(ids) + max_tokens
        # the BOS is context: the first echoed token is position 1, with its logprob
        assert lp["token_logprobs"][:len(ids)] == [-float(i) for i in range(1, len(ids) + 1)]


@pytest.mark.parametrize("text", TEXTS)
def test_echoed_tokens_spell_a_text_prompt_on_the_tiny_tokenizer(tiny_tokenizer, text):
    check_text_prompt(tiny_tokenizer, text)


@pytest.mark.slow
@pytest.mark.parametrize("text", [ISSUE_TEXT, *TEXTS])
def test_echoed_tokens_spell_a_text_prompt_on_gemma3(gemma_tokenizer, text):
    check_text_prompt(gemma_tokenizer, text)


@pytest.mark.slow
def test_control_tokens_are_echoed_with_their_text_on_gemma3(gemma_tokenizer):
    tokenizer = gemma_tokenizer
    ids = tokenizer.encode(ISSUE_TEXT)
    assert ids[:4] == [2, 105, 2364, 107]
    c = echoed(tokenizer, scored({"tokens": ids}, ids, generated=106), max_tokens=1)
    assert_spelled(c)
    lp = c["logprobs"]
    assert lp["tokens"][:4] == ["<bos>", "<start_of_turn>", "user", "\n"]
    assert lp["text_offset"][:5] == [0, 5, 20, 24, 25]
    assert c["text"] == "<bos>" + ISSUE_TEXT + "<end_of_turn>"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None


def test_a_character_in_byte_tokens_belongs_to_the_token_that_completes_it(tiny_tokenizer):
    tokenizer = tiny_tokenizer
    ids = tokenizer.encode("a 𓀀 b", add_bos=False)
    c = echoed(tokenizer, scored({"tokens": ids}, ids, generated=ids[0]), max_tokens=0)
    assert_spelled(c)
    assert c["logprobs"]["tokens"] == ["a", " ", "", "", "", "𓀀", " ", "b"]
    assert c["logprobs"]["text_offset"] == [0, 1, 2, 2, 2, 2, 3, 4]


def test_with_bos_puts_one_before_token_ids_that_lack_it():
    inputs = [{"tokens": [5, 6]}, {"tokens": [2, 5]}, {"prompt": "text"}, {"tokens": []}]
    assert with_bos(inputs, 2) == [{"tokens": [2, 5, 6]}, {"tokens": [2, 5]},
                                   {"prompt": "text"}, {"tokens": []}]
    assert with_bos(inputs, None) == inputs


def test_the_bos_put_before_token_ids_is_context_not_echo(tiny_tokenizer):
    tokenizer = tiny_tokenizer
    ids = tokenizer.encode("a 𓀀 b", add_bos=False)
    (job_input,) = with_bos([{"tokens": ids}], tokenizer.bos_id)
    c = echoed(tokenizer, scored({"tokens": ids}, job_input["tokens"], generated=ids[0]), 1)
    assert_spelled(c)
    lp = c["logprobs"]
    assert c["text"] == "a 𓀀 b" + tokenizer.piece(ids[0])
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] == -1.0
    assert lp["top_logprobs"][0] is not None
