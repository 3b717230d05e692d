"""SmolLM2-135M (`smollm2-135m`, the real Q4_1 GGUF) through everything the product does,
on a real redis-server: a session's turns (live, recovery anchor, reset) rendered through
the GGUF's own chat template, each equal to a cold prefill; a job whose worker is SIGKILLed
resuming from its KV checkpoint on another; prompt log-probabilities; and
``/v1/completions`` with echo through the gateway."""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest

from jobs import JobState, PrefillClient, keys
from tests.integration.processes import GatewayProcess, wait_for
from tests.jobs.test_gateway_completions import assert_spelled
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

MODEL = "smollm2-135m"
CHUNK = 64
# Chunked prefill of this model against one pass measures 1.1e-6 to 1.3e-6 x max|logit|
# (tests/model/test_smollm2.py); a turn from a slot or a checkpoint is the same arithmetic.
CLOSE = 5e-6
SYSTEM = ("You are a careful assistant for a travel office. Answer in one short sentence, "
          "name the city first, and say nothing about prices or dates unless asked. ") * 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from model.registry import load_model

    return load_model(MODEL)


def relative_diff(got: np.ndarray, expected: np.ndarray) -> float:
    assert got.argmax() == expected.argmax()
    return float(np.abs(got - expected).max()) / float(np.abs(expected).max())


def test_session_turns_reuse_live_anchor_and_reset_and_equal_cold(connect, smollm2):
    worker = PrefillWorker({MODEL: smollm2}, connect(),
                           WorkerSettings(chunk_tokens=CHUNK), name="w1")
    worker.register_models()
    client = PrefillClient(connect())
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Which city is the capital of France?"}]
    second = [*first, {"role": "assistant", "content": "Paris is the capital of France."},
              {"role": "user", "content": "And the capital of Italy?"}]
    turns = [(first, True, "cold"), (second, True, "live"),
             (second, False, "recovery-anchor"),  # the generation prompt's tail rewritten
             ([{"role": "user", "content": "Name a large river in Africa. " * 30}], True,
              "reset")]
    for messages, generation_prompt, reuse in turns:
        job = client.submit(messages=messages, model=MODEL, top_k=5, logits="full",
                            session="trip", add_generation_prompt=generation_prompt)
        worker.work(burst=True, logging_level="WARNING")
        worker.register_models()  # a burst run ends by deregistering
        result = client.result(job, timeout=0)
        assert result.reuse == reuse
        ids = smollm2.tokenizer.apply_chat_template(messages,
                                                    add_generation_prompt=generation_prompt)
        cold = smollm2.start_prefill(ids).run()
        assert relative_diff(np.asarray(result.logits), cold) <= CLOSE


def test_prompt_logprobs_equal_in_process(connect, smollm2):
    worker = PrefillWorker({MODEL: smollm2}, connect(),
                           WorkerSettings(chunk_tokens=CHUNK), name="w1")
    worker.register_models()
    client = PrefillClient(connect())
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and the capital of "
                                   "Italy is Rome. " * 8)
    job = client.submit(tokens=ids, model=MODEL, top_k=3, prompt_logprobs=3)
    worker.work(burst=True, logging_level="WARNING")
    got = client.result(job, timeout=0).prompt_logprobs
    expected = smollm2.start_prefill(ids, chunk_tokens=CHUNK, prompt_logprobs=3)
    expected.run()
    assert [e["token"] for e in got[:-1]] == ids
    assert got[0]["logprob"] is None
    np.testing.assert_allclose([e["logprob"] for e in got[1:-1]],
                               expected.logprobs.token_logprob[1:len(ids)], rtol=0, atol=1e-5)


def test_a_sigkilled_workers_job_resumes_from_its_checkpoint(server, workers, smollm2):
    client = PrefillClient.from_url(server.url)
    ids = smollm2.tokenizer.encode(" ".join(f"Item {i} is number {i}." for i in range(200)))
    args = ("--model", MODEL, "--chunk-tokens", str(CHUNK), "--checkpoint-every", "1")
    first = workers("w1", *args)
    job = client.submit(tokens=ids, model=MODEL, top_k=5, logits="full")

    def checkpointed_past_half() -> bool:
        cursor = client.redis.hget(keys.job(job), "checkpoint_cursor")
        return int(cursor or 0) >= len(ids) // 2

    wait_for(checkpointed_past_half, 120, "w1 never checkpointed past half", first)
    first.signal(signal.SIGKILL)
    first.wait()
    saved = int(client.redis.hget(keys.job(job), "checkpoint_cursor"))
    workers("w2", *args)
    result = client.result(job, timeout=180)
    status = client.status(job)
    assert (status.state, status.worker, status.resumed_from) == (JobState.FINISHED, "w2", saved)
    cold = smollm2.start_prefill(ids).run()
    assert relative_diff(np.frombuffer(result.logits, dtype=np.float32), cold) <= CLOSE


def test_completions_echo_spells_the_prompt_and_scores_it(server, workers, tmp_path):
    workers("w1", "--model", MODEL, "--chunk-tokens", str(CHUNK))
    client = PrefillClient.from_url(server.url)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    body = {"model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}
    gateway = GatewayProcess(server.url, tmp_path)
    try:
        response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=120)
    finally:
        gateway.stop()
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == text
    assert_spelled(choice)
    native = client.result(client.submit(prompt=text, model=MODEL, top_k=1, prompt_logprobs=1),
                           timeout=120)
    positions = native.prompt_logprobs[:-1]  # SmolLM2 adds no BOS: every token is echoed
    assert [e["token"] for e in positions] == client.tokenizer(MODEL).encode(text)
    assert choice["logprobs"]["token_logprobs"] == [e["logprob"] for e in positions]
