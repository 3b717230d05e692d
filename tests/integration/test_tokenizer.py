"""A ``prefillq worker`` process publishes its model's tokenizer, clients tokenize with it
exactly as the worker does, and its heartbeat thread publishes it again after Redis lost its
data (a restart without persistence)."""

from __future__ import annotations

import redis

from jobs import PrefillClient, keys

from .processes import MODEL, wait_for

TEXTS = ["<start_of_turn>user\nHello, world!<end_of_turn>", "  the\n\ncapital  ", ""]


def test_worker_process_publishes_its_tokenizer_and_restores_it(server, workers, tiny):
    w1 = workers("w1")
    conn, key = redis.Redis.from_url(server.url), keys.tokenizer(tiny.sha256)
    blob = conn.get(key)
    assert blob is not None and conn.ttl(key) == -1
    st = PrefillClient.from_url(server.url).tokenizer(MODEL)
    for text in TEXTS:
        for parse_special in (True, False):
            assert st.encode(text, parse_special=parse_special) == tiny.tokenizer.encode(
                text, parse_special=parse_special)
    ids = list(range(tiny.vocab_size))
    assert [st.piece(i) for i in ids] == [tiny.tokenizer.piece(i) for i in ids]

    conn.flushall()  # every key gone; the next beat (every ttl/6 = 1/3 s) writes it back
    wait_for(lambda: conn.exists(key), 10, "the tokenizer was not published again", w1)
    assert conn.get(key) == blob
    assert PrefillClient.from_url(server.url).tokenizer(MODEL).encode(TEXTS[0]) == st.encode(
        TEXTS[0])
