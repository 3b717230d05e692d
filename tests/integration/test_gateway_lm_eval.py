"""lm-evaluation-harness's ``local-completions`` model with ``tokenizer_backend=remote``
against ``prefillq serve`` as real uvicorn processes, one plain and one with
``--score-with-bos``, over a real redis-server and a worker process on Gemma 3 270M. The
requests are lm-eval's: its ``RemoteTokenizer`` (``lm_eval/utils.py``) tokenizes with
``add_special_tokens: false``, ``_encode_pair`` (``lm_eval/api/model.py``) splits context and
continuation, and ``_create_payload`` / ``parse_logprobs``
(``lm_eval/models/openai_completions.py``) build the scoring request and read it. Also the
issue's chat text, whose control tokens the echo and ``/detokenize`` spell out."""

from __future__ import annotations

import httpx
import pytest

from jobs import PrefillClient
from tests.conftest import RedisServer
from tests.integration.processes import GatewayProcess, WorkerProcess
from tests.integration.test_gateway import lm_eval_loglikelihood
from tests.jobs.test_gateway_completions import ISSUE_TEXT, assert_spelled

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
LM_EVAL_MAX_LENGTH = 2048 - 1  # TemplateAPI's default max_length, less the generated token


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-lm-eval")
    server = RedisServer(tmp).start()
    worker = WorkerProcess(server.url, "lme1", tmp, "--model", MODEL)  # and the tiny model
    plain = GatewayProcess(server.url, tmp, name="plain")
    with_bos = GatewayProcess(server.url, tmp, "--score-with-bos", name="with-bos")
    yield server, plain, with_bos
    with_bos.stop()
    plain.stop()
    worker.stop()
    server.stop()


def remote_encode(url: str, text: str) -> list[int]:
    """lm-eval's ``RemoteTokenizer.encode``."""
    response = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return response.json()["tokens"]


def lm_eval_request(url: str, context: str, continuation: str) -> tuple[dict, int]:
    """lm-eval's loglikelihood request for one (context, continuation) pair, and its ctxlen."""
    httpx.get(url + "/tokenizer_info").raise_for_status()  # RemoteTokenizer._validate_server
    spaces = len(context) - len(context.rstrip())  # _encode_pair moves them to the continuation
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = remote_encode(url, context + continuation)
    context_enc = remote_encode(url, context)
    tokens = (context_enc + whole[len(context_enc):])[-LM_EVAL_MAX_LENGTH:]
    payload = {"model": MODEL, "prompt": [tokens], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    return payload, len(context_enc)


def score(url: str, payload: dict, ctxlen: int) -> tuple[float, dict]:
    response = httpx.post(url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    ((logprob, _),) = lm_eval_loglikelihood(response.json(), [ctxlen])
    return logprob, response.json()["choices"][0]


@pytest.mark.parametrize("context, bounds", [
    # measured on the CPU in float32: -0.833 after the BOS, -8.560 without
    ("Question: What is the capital of France?\nAnswer:", (-1.0, -8.0)),
    # here the BOS hardly matters (-2.477 after it, -2.436 without)
    ("The capital of France is", None),
])
def test_lm_eval_scores_gemma_after_its_bos_with_score_with_bos(stack, context, bounds):
    server, plain, with_bos = stack
    payload, ctxlen = lm_eval_request(plain.url, context, " Paris")
    tokens = payload["prompt"][0]
    assert tokens[0] != 2 and ctxlen == len(tokens) - 1  # no BOS: what the issue found
    without, _ = score(plain.url, payload, ctxlen)
    scored, choice = score(with_bos.url, payload, ctxlen)
    if bounds is not None:
        assert scored > bounds[0] and without < bounds[1], (scored, without)
    # the same tokens' value after the BOS, from a native job
    client = PrefillClient.from_url(server.url)
    native = client.result(client.submit(tokens=[2, *tokens], model=MODEL, top_k=1,
                                         prompt_logprobs=1), timeout=120)
    assert scored == sum(e["logprob"] for e in native.prompt_logprobs[ctxlen + 1:-1])
    # the echo covers exactly the client's tokens, the first one now scored after the BOS
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(tokens) + 1 and lp["token_logprobs"][0] is not None
    assert_spelled(choice)
    assert choice["text"] == context + " Paris" + lp["tokens"][-1]


def test_the_issues_chat_text_echoes_its_control_tokens(stack):
    _, plain, _ = stack
    ids = httpx.post(plain.url + "/tokenize", json={"prompt": ISSUE_TEXT}).json()["tokens"]
    assert ids[:4] == [2, 105, 2364, 107]
    for skip, text in ((False, "<bos>" + ISSUE_TEXT), (True, "user\n你好🤖\nmodel\n")):
        back = httpx.post(plain.url + "/detokenize",
                          json={"tokens": ids, "skip_special_tokens": skip})
        assert back.json() == {"prompt": text}
    response = httpx.post(plain.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ISSUE_TEXT, "echo": True, "logprobs": 1, "max_tokens": 0})
    (choice,) = response.json()["choices"]
    assert choice["text"] == ISSUE_TEXT
    assert_spelled(choice)
    lp = choice["logprobs"]
    assert lp["tokens"][:4] == ["<start_of_turn>", "user", "\n", "你好"]
    assert lp["text_offset"][:4] == [0, 15, 19, 20]
