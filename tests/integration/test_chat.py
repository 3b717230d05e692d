"""Chat messages through the queue: PrefillClient(messages=...) -> a real redis-server ->
PrefillWorker, which renders them with the model's chat template and tokenizes them once."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jobs import JobFailed, JobState, PrefillClient
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

MODEL = "gemma3-270m"
CHAT = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And the capital of Italy?"},
]


def serve(connect, models: dict) -> PrefillWorker:
    # one job a step: a packed step's jobs differ from each other in their last bits (the
    # rows' places in the matmuls), and these tests compare jobs bitwise
    worker = PrefillWorker(models, connect(), WorkerSettings(max_batch_jobs=1), name="w1")
    worker.register_models()
    return worker


def test_messages_prefill_exactly_as_their_rendered_text(connect, gemma):
    worker = serve(connect, {MODEL: gemma})
    client = PrefillClient(connect())
    rendered = gemma.tokenizer.render_chat(CHAT)
    assert rendered.startswith("<bos><start_of_turn>user\nAnswer with one word.\n\n")
    chat = client.submit(messages=CHAT, model=MODEL, top_k=10, logits="full")
    # the same text as a prompt: the prompt path adds the BOS itself (add_bos_token) and
    # parses special tokens, so the template's written-out <bos> is left off
    text = client.submit(prompt=rendered.removeprefix("<bos>"), model=MODEL, top_k=10,
                         logits="full")
    no_generation = client.submit(messages=CHAT, add_generation_prompt=False, model=MODEL)
    worker.work(burst=True)

    by_chat, by_text = client.result(chat, timeout=0), client.result(text, timeout=0)
    ids = gemma.tokenizer.apply_chat_template(CHAT)
    assert ids[0] == gemma.tokenizer.bos_id and ids.count(gemma.tokenizer.bos_id) == 1
    assert by_chat.n_tokens == by_text.n_tokens == len(ids) == client.status(chat).n_tokens
    assert [t.id for t in by_chat.top_k] == [t.id for t in by_text.top_k]
    # same ids and the same chunk plan: the same computation, so the logits agree exactly
    # (measured max |diff| 0.0)
    diff = np.abs(np.asarray(by_chat.logits) - np.asarray(by_text.logits)).max()
    assert diff == 0.0
    assert by_chat.top_k[0].piece == "Rome"  # the model answers in Gemma's turn format

    # without the generation prompt the job ends after the last user turn:
    # "<start_of_turn>", "model", "\n" fewer
    assert client.result(no_generation, timeout=0).n_tokens == len(ids) - 3


def test_a_template_error_fails_only_its_job(connect, gemma, tiny):
    worker = serve(connect, {MODEL: gemma, "gemma3-tiny": tiny})
    client = PrefillClient(connect())
    out_of_order = client.submit(messages=[{"role": "assistant", "content": "Hi"}], model=MODEL)
    no_template = client.submit(messages=CHAT, model="gemma3-tiny")
    fine = client.submit(messages=CHAT[1:2], model=MODEL, top_k=1)
    worker.work(burst=True)

    with pytest.raises(JobFailed) as failed:
        client.result(out_of_order, timeout=0)
    assert failed.value.error_type == "ChatTemplateError"
    assert "must alternate user, assistant" in failed.value.message
    with pytest.raises(JobFailed) as failed:
        client.result(no_template, timeout=0)
    assert failed.value.error_type == "ChatTemplateMissing"
    assert client.status(fine).state == JobState.FINISHED
    assert client.result(fine, timeout=0).n_tokens == len(
        gemma.tokenizer.apply_chat_template(CHAT[1:2]))


def test_run_takes_a_messages_file(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user", "content": "Hi"}]')
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--model", "gemma3-tiny", "--quiet",
         "--messages-file", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    # the tiny model's GGUF has no template: the job fails with the typed error, exit 1
    assert proc.returncode == 1, proc.stderr
    assert "failed: ChatTemplateMissing: this model has no chat template" in proc.stderr
