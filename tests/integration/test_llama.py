"""A Llama-family model served end to end: a ``prefillq worker`` process on a real
redis-server serving ``llama-tiny`` by name (beside ``gemma3-tiny``), its results equal to
the same prefill in this process, for token ids, a text prompt (the worker's byte-level BPE
tokenizer) and prompt log-probabilities."""

from __future__ import annotations

import numpy as np

from jobs import PrefillClient
from model.registry import load_model

LLAMA = "llama-tiny"
CHUNK = 4  # the worker's --chunk-tokens (`WorkerProcess`)


def test_a_llama_tiny_job_runs_end_to_end_with_in_process_logits(server, workers):
    loaded = load_model(LLAMA)
    client = PrefillClient.from_url(server.url)
    # one-job steps: the same graphs as in process (packed steps: test_packed_steps.py)
    workers("w1", "--model", LLAMA, "--max-batch-jobs", "1")
    token_ids = [int(t) for t in np.random.default_rng(7).integers(0, loaded.vocab_size, 90)]
    by_ids = client.submit(tokens=token_ids, model=LLAMA, top_k=5, logits="full")
    text = "the tiny model is the one in the test"
    by_text = client.submit(prompt=text, model=LLAMA, top_k=5, logits="full")
    with_logprobs = client.submit(tokens=token_ids[:30], model=LLAMA, prompt_logprobs=2)

    result = client.result(by_ids, timeout=120)
    assert result.chunks_done == 90 // CHUNK + 1 and result.n_tokens == 90
    expected = loaded.start_prefill(token_ids, chunk_tokens=CHUNK).run()
    # the same chunks in the same float32 graphs: bitwise the in-process logits
    np.testing.assert_array_equal(np.frombuffer(result.logits, dtype=np.float32), expected)
    assert [t.id for t in result.top_k] == np.argsort(-expected)[:5].tolist()

    text_ids = loaded.tokenizer.encode(text)
    assert text_ids[0] == 0  # llama-bpe adds the BOS
    result = client.result(by_text, timeout=120)
    assert result.n_tokens == len(text_ids)
    expected = loaded.start_prefill(text_ids, chunk_tokens=CHUNK).run()
    np.testing.assert_array_equal(np.frombuffer(result.logits, dtype=np.float32), expected)

    entries = client.result(with_logprobs, timeout=120).prompt_logprobs
    prefill = loaded.start_prefill(token_ids[:30], chunk_tokens=CHUNK, prompt_logprobs=2)
    prefill.run()
    ours = prefill.logprobs
    assert [e["token"] for e in entries] == [*token_ids[:30], None]
    assert [e["logprob"] for e in entries[1:30]] == ours.token_logprob[1:30].tolist()
    assert [[t["id"] for t in e["top"]] for e in entries[1:]] == ours.top_ids[1:].tolist()
