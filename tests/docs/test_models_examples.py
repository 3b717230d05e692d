"""docs/models.md's SmolLM2 examples, run as written (`tests.docs.examples`) against a real
redis-server (`tests.docs.conftest`), with the page's own ``prefillq worker`` and ``prefillq
serve``: what each prints is what the page says it prints."""

from __future__ import annotations

import json

import pytest

from tests.docs.examples import find, output_of

pytestmark = pytest.mark.slow
SESSION = "smollm2"
PAGE = "docs/models.md"


def test_the_smollm2_examples_print_what_the_page_says(example_scripts):
    script = example_scripts[SESSION]
    blocks, printed = script.blocks, script.printed()
    ran = find(blocks, PAGE, "prefillq run --model smollm2-135m")
    first = next(ln for ln in printed[ran].splitlines() if ln.lstrip().startswith("1 "))
    assert first.endswith("' Paris'") and "logit   17.37" in first, printed[ran]
    chat = find(blocks, PAGE, "from jobs import PrefillClient")
    assert printed[chat] == output_of(blocks, chat).text.strip()
    served = find(blocks, PAGE, "prefillq serve")
    got, said = json.loads(printed[served]), json.loads(output_of(blocks, served).text)
    for name in ("object", "model", "usage"):
        assert got[name] == said[name], name
    (choice,), (said_choice,) = got["choices"], said["choices"]
    assert choice["text"] == said_choice["text"]
    logprobs, said_logprobs = choice["logprobs"], said_choice["logprobs"]
    assert logprobs["tokens"] == said_logprobs["tokens"]
    assert logprobs["text_offset"] == said_logprobs["text_offset"]
    # the page rounds what it shows to 3 decimals
    assert [None if lp is None else round(lp, 3) for lp in logprobs["token_logprobs"]] == \
        said_logprobs["token_logprobs"]
    assert [None if top is None else {k: round(v, 3) for k, v in top.items()}
            for top in logprobs["top_logprobs"]] == said_logprobs["top_logprobs"]
