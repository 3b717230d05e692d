"""The Gemma 3 pages' examples (operations.md's real Redis, the README's client, client.md,
sessions.md, gateway.md), run as written (`tests.docs.examples`) in one script: operations.md
starts the redis-server and the ``prefillq worker`` every later block uses, so the model loads
once. What each prints is what its page says it prints."""

from __future__ import annotations

import ast
import json
import re

import pytest

from tests.docs.examples import ROOT, find, output_of

pytestmark = pytest.mark.slow
SESSION = "gemma3"
STATES = {"queued", "prefilling", "finished", "failed", "canceled"}
# float32 logits differ between runs and BLAS builds by ~1e-5; a shown value is rounded
FLOAT_NOISE = 1e-4


@pytest.fixture(scope="module")
def session(example_scripts):
    """The session's blocks and what each printed."""
    script = example_scripts[SESSION]
    return script.blocks, script.printed()


def printed_by(session, page: str, starts: str) -> list[str]:
    blocks, printed = session
    return printed[find(blocks, page, starts)].splitlines()


def comment(block_text: str, code: str) -> str:
    """The ``# ...`` comment on the line of `block_text` that holds `code`."""
    (line,) = [ln for ln in block_text.splitlines() if code in ln]
    return line.split("# ", 1)[1].strip()


def shown_as(got: float, shown: float, decimals: int = 3) -> bool:
    return abs(got - shown) <= 0.5 * 10 ** -decimals + FLOAT_NOISE


def test_operations_run_against_a_real_redis(session):
    out = printed_by(session, "docs/operations.md", "redis-server &")
    assert re.match(r"job \w+: finished, 6 tokens in 1 chunk", out[0]), out
    ranked = [ln for ln in out if re.match(r"\s*\d+\s+\d+\s+logit", ln)]
    assert len(ranked) == 10 and ranked[0].endswith("' the'"), out


def test_the_readme_client_prints_the_state_then_the_top_tokens(session):
    out = printed_by(session, "README.md", "from jobs import PrefillClient, JobFailed")
    assert out[0] in STATES
    # the README: `make run` prints ` the`, ` a`, ` Paris`, ...
    assert [ast.literal_eval(ln.split(" ", 1)[1].rsplit(" ", 2)[0]) for ln in out[1:4]] == \
        [" the", " a", " Paris"]
    assert len(out) == 1 + 5


def test_the_asyncio_client_watches_then_gets_the_result(session):
    blocks, printed = session
    block = find(blocks, "docs/client.md", "import asyncio")
    *watched, pieces = printed[block].splitlines()
    states = [ln.split()[0] for ln in watched]
    # the status now (queued unless a worker took it already), one per change, terminal last
    assert states[0] in ("queued", "prefilling") and set(states[1:-1]) <= {"prefilling"}
    assert watched[-1] == "finished 6 6"
    said = comment(block.text, "print([t.piece").removesuffix(", ...]") + "]"
    assert ast.literal_eval(pieces)[:3] == ast.literal_eval(said)


def test_the_chat_examples(session):
    blocks, printed = session
    block = find(blocks, "docs/client.md", "from jobs import PrefillClient")
    assert printed[block] == comment(block.text, "top_k[0].piece")  # Rome
    (job_id,) = printed_by(session, "docs/client.md", "echo '[")
    assert re.fullmatch(r"[0-9a-f]{32}", job_id)


def test_the_session_turns_are_the_pages_table(session):
    out = printed_by(session, "docs/sessions.md", "from jobs import PrefillClient")
    page = (ROOT / "docs/sessions.md").read_text()
    rows = re.findall(r"^\| \d \| (\d+) \| (\d+) \| `([\w-]+)` \| (\d+) \(", page, re.M)
    assert len(rows) == 3
    assert [ln.split() for ln in out] == [list(row) for row in rows]


def sse_events(lines: list[str]) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_the_native_jobs_api(session):
    blocks, printed = session
    block = find(blocks, "docs/gateway.md", "prefillq serve")
    submitted, result, deleted, *stream = printed[block].splitlines()
    submitted = json.loads(submitted)
    assert set(submitted) == {"job_id", "state"} and submitted["state"] == "queued"
    result = json.loads(result)
    assert (result["job_id"], result["state"], result["n_tokens"]) == \
        (submitted["job_id"], "finished", 6)
    assert [(t["id"], t["piece"]) for t in result["top_k"]] == \
        [(506, " the"), (496, " a"), (9079, " Paris")]
    assert shown_as(result["top_k"][0]["logit"], 19.09, 2)
    assert shown_as(result["top_k"][0]["logprob"], -1.654)
    assert json.loads(deleted) == {"job_id": submitted["job_id"], "changed": False,
                                   "state": "finished"}
    events = sse_events(stream)
    said = dict(re.findall(r'"(n_tokens|chunks_done)": (\d+)', block.text.split("/events")[1]))
    (first_name, first), *middle, (last_name, last) = events
    assert first_name == "status" and first["state"] in ("queued", "prefilling")
    assert all(name == "status" and e["state"] == "prefilling" for name, e in middle)
    assert (last_name, last["state"], last["cursor"], last["progress"], last["chunks_done"]) == \
        ("finished", "finished", int(said["n_tokens"]), 1.0, int(said["chunks_done"]))


def test_the_completions_answer_is_the_pages(session):
    blocks, printed = session
    block = find(blocks, "docs/gateway.md", "curl -s localhost:8000/v1/completions")
    got, said = json.loads(printed[block]), json.loads(output_of(blocks, block).text)
    assert set(got) == set(said)
    for name in ("object", "model", "usage"):
        assert got[name] == said[name], name
    (choice,), (said_choice,) = got["choices"], said["choices"]
    assert set(choice) == set(said_choice)
    assert (choice["text"], choice["finish_reason"]) == \
        (said_choice["text"], said_choice["finish_reason"])
    logprobs, said_logprobs = choice["logprobs"], said_choice["logprobs"]
    assert logprobs["tokens"] == said_logprobs["tokens"]
    assert logprobs["text_offset"] == said_logprobs["text_offset"]
    assert logprobs["token_logprobs"][0] is None is said_logprobs["token_logprobs"][0]
    assert all(shown_as(g, s) for g, s in
               zip(logprobs["token_logprobs"][1:], said_logprobs["token_logprobs"][1:],
                   strict=True))
    for top, said_top in zip(logprobs["top_logprobs"][1:], said_logprobs["top_logprobs"][1:],
                             strict=True):
        assert top.keys() == said_top.keys() and all(shown_as(top[k], said_top[k]) for k in top)


def test_the_openai_client(session):
    blocks, printed = session
    block = find(blocks, "docs/gateway.md", "from openai import OpenAI")
    text, top = printed[block].splitlines()
    assert text == comment(block.text, "print(repr(")
    assert top == block.text.rstrip().splitlines()[-1].removeprefix("# ")
