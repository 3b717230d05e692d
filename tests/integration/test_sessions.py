"""Sessions end to end on a real redis-server: a three-turn chat on the real Gemma 3 270M
reuses more of its slot every turn and equals a cold prefill each time, and a session whose
holder is SIGKILLed continues on another worker from its slot's checkpoint, still right."""

from __future__ import annotations

import signal

import numpy as np

from jobs import JobState, PrefillClient, keys
from tests.model.test_gemma3 import CHUNKED_MAX_DIFF
from worker.worker import PrefillWorker

from .processes import MODEL as TINY
from .processes import expected_top, ids, wait_for

MODEL = "gemma3-270m"
SYSTEM = ("You are a patient geography tutor. Answer every question with the city's name "
          "first, then one short sentence about why it matters, and never more than that. "
          "If a question is ambiguous, answer for the country most people mean, and say "
          "which one you chose. Keep the tone friendly and plain, avoid lists, and do not "
          "repeat the question back. ") * 2
TURNS = [
    ("What is the capital of France?", "Paris. It has been the seat of French government "
                                       "for most of the last thousand years."),
    ("And the capital of Italy?", "Rome. It was the centre of the Roman Empire."),
    ("And of Spain?", None),
]


def chat_turns() -> list[list[dict]]:
    """The messages of each turn: the history so far, then the new user message."""
    history, out = [{"role": "system", "content": SYSTEM}], []
    for question, answer in TURNS:
        history = [*history, {"role": "user", "content": question}]
        out.append(history)
        if answer is not None:
            history = [*history, {"role": "assistant", "content": answer}]
    return out


def test_a_three_turn_chat_reuses_more_every_turn_and_equals_cold(connect, gemma):
    worker = PrefillWorker({MODEL: gemma}, connect(), name="w1")
    worker.register_models()
    client = PrefillClient(connect())
    seen = []
    for messages in chat_turns():
        job = client.submit(messages=messages, model=MODEL, top_k=5, logits="full",
                            session="tutor")
        worker.work(burst=True, logging_level="WARNING")
        worker.register_models()  # a burst run ends by deregistering; the next turn routes here
        result = client.result(job, timeout=0)
        token_ids = gemma.tokenizer.apply_chat_template(messages)
        cold = gemma.start_prefill(token_ids).run()
        got = np.asarray(result.logits)
        diff = float(np.abs(got - cold).max())
        assert diff <= 1e-3 * float(np.abs(cold).max()) and got.argmax() == cold.argmax()
        # the regression bound of chunked prefill; these three turns measured 0.0 each
        # (2026-12-01, 2-core AMD EPYC, OpenBLAS Cooperlake kernels)
        assert diff <= CHUNKED_MAX_DIFF, diff
        seen.append((result.reuse, result.cached_tokens, result.n_tokens))
    (r1, c1, n1), (r2, c2, n2), (r3, c3, n3) = seen
    assert (r1, c1) == ("cold", 0)
    # each prompt extends the last one (the model's answer and a new question appended)
    assert r2 == r3 == "live"
    assert c2 == n1 and c3 == n2
    assert 0 < c2 < c3


def test_a_session_whose_holder_is_killed_continues_on_another_worker(server, workers, tiny):
    """The holder's slot dies with it; its checkpoint (written when the turn finished) lets
    another worker reuse the prefix instead of running cold."""
    client = PrefillClient.from_url(server.url)
    w1 = workers("w1")
    history = ids(200, 21)
    first = client.submit(tokens=history, model=TINY, session="s")
    assert client.result(first, timeout=60).reuse == "cold"
    wait_for(lambda: client.session_holder("s") == "w1", 10, "w1 never held the session")
    wait_for(lambda: client.redis.exists(keys.session_checkpoint("s", "record")), 10,
             "w1 never checkpointed the session's slot", w1)
    w1.signal(signal.SIGKILL)
    w1.wait()
    follow_ids = history + ids(41, 22)[1:]
    # routed to w1 while its heartbeat lives (up to the 2 s TTL), then reaped to intake
    job = client.submit(tokens=follow_ids, model=TINY, top_k=5, session="s")
    workers("w2")
    result = client.result(job, timeout=60)
    status = client.status(job)
    assert (status.state, status.worker) == (JobState.FINISHED, "w2")
    assert (result.reuse, result.cached_tokens) == ("live", 200)
    top, _ = expected_top(tiny, follow_ids, 5)
    assert [t.id for t in result.top_k] == top
    assert not client.redis.exists(keys.own_queue("w1"))
