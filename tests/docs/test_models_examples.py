"""docs/models.md's SmolLM2 examples, run as written (`tests.docs.examples`) against a real
redis-server, a ``prefillq worker`` and a ``prefillq serve`` of their own: what each prints
is what the page says it prints."""

from __future__ import annotations

import json

import pytest

from tests.docs.examples import run_blocks, section_blocks
from worker.redis_server import RedisServer, free_port

pytestmark = pytest.mark.slow
HEADING = "### The README's examples on SmolLM2"


def test_the_smollm2_examples_print_what_the_page_says(tmp_path):
    blocks = section_blocks("docs/models.md", HEADING)
    assert [b.lang for b in blocks] == ["sh", "python", "text", "sh", "json"]
    with RedisServer() as server:
        printed = run_blocks(blocks, server.url, free_port(), tmp_path)
    assert printed[1] == blocks[2].text.strip()
    got, said = json.loads(printed[3]), json.loads(blocks[4].text)
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
