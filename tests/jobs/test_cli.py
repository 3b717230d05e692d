"""The client commands of the CLI run from an install without MLX (a web backend's)."""

from __future__ import annotations

import json
import subprocess
import sys

from jobs import keys
from jobs.serializer import packb

# What an install of the light client lacks (`prefillq[worker]` adds it).
WORKER_EXTRA = ("mlx", "numpy", "tqdm", "fakeredis", "gguf", "tokenizers")


def light_prefillq(*args: str, blocked=("model", *WORKER_EXTRA)) -> subprocess.CompletedProcess:
    """`prefillq ARGS` with `blocked` packages made unimportable (by default also model/,
    so a client command that imported it would fail)."""
    code = (f"import sys\nfor name in {tuple(blocked)!r}: sys.modules[name] = None\n"
            "from worker.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60)


def test_submit_status_cancel_result_and_reap_need_no_mlx(redis_server):
    import redis

    r = redis.Redis.from_url(redis_server)
    r.flushall()
    r.hset(keys.MODELS, "m", packb({"vocab_size": 100, "context_length": 64,
                                    "architecture": "gemma3", "sha256": "0" * 64}))
    submit = light_prefillq("submit", "--redis", redis_server, "--model", "m", "--prompt", "hi")
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.split()[-1]

    status = light_prefillq("status", "--redis", redis_server, job_id, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "queued"

    cancel = light_prefillq("cancel", "--redis", redis_server, job_id)
    assert cancel.returncode == 0 and cancel.stdout.strip() == "canceled"  # it had not started

    result = light_prefillq("result", "--redis", redis_server, job_id)
    assert result.returncode == 1 and "canceled" in result.stderr

    reap = light_prefillq("reap", "--redis", redis_server)
    assert reap.returncode == 0 and "reaped 0 jobs" in reap.stdout


def test_a_write_redis_refuses_is_a_one_line_error(redis_server):
    import redis

    r = redis.Redis.from_url(redis_server)
    r.flushall()
    r.hset(keys.MODELS, "m", packb({"vocab_size": 100, "context_length": 64,
                                    "architecture": "gemma3", "sha256": "0" * 64}))
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # below use: every write that grows memory is refused
    try:
        submit = light_prefillq("submit", "--redis", redis_server, "--model", "m",
                                "--prompt", "hi")
    finally:
        r.config_set("maxmemory", 0)
    assert submit.returncode == 2  # it was a 52-line traceback, exit 1
    assert submit.stderr.startswith("prefillq: error: Redis refused the write")
    assert submit.stderr.count("\n") == 1, submit.stderr


def test_the_light_client_refuses_a_bad_request_in_one_line(redis_server):
    proc = light_prefillq("submit", "--redis", redis_server, "--model", "nope", "--prompt", "x")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "no registered worker serves model 'nope'" in proc.stderr


def test_worker_commands_in_the_light_client_fail_in_one_line(redis_server):
    import redis

    r = redis.Redis.from_url(redis_server)
    r.flushall()
    r.hset(keys.MODELS, "m", packb({"vocab_size": 100, "context_length": 64,
                                    "architecture": "gemma3", "sha256": "0" * 64}))
    # `run --redis` is a client: it submits and waits, with no progress bar (tqdm is absent)
    waited = light_prefillq("run", "--redis", redis_server, "--model", "m", "hi", "--wait", "1",
                            blocked=WORKER_EXTRA)
    assert waited.returncode == 2
    assert waited.stderr.strip().splitlines()[-1].endswith("is still queued")
    assert "Traceback" not in waited.stderr
    for args in (("run", "hi"), ("plan", "--model", "deepseek4-flash")):
        proc = light_prefillq(*args, blocked=WORKER_EXTRA)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"prefillq: error: `prefillq {args[0]}` needs the worker extra (missing mlx): "
            "pip install 'prefillq[worker]'"]


def test_a_closed_stdout_is_not_an_error():
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m worker plan --model "
         "deepseek4-flash | head -1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("deepseek4-flash: 43 layers") and proc.stderr == ""


def test_submit_messages_file_needs_no_mlx_nor_jinja(redis_server, tmp_path):
    import redis

    from jobs.record import JobRecord

    r = redis.Redis.from_url(redis_server)
    r.flushall()
    r.hset(keys.MODELS, "m", packb({"vocab_size": 100, "context_length": 64,
                                    "architecture": "gemma3", "sha256": "0" * 64}))
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    light = ("model", "jinja2", *WORKER_EXTRA)
    for extra, generation_prompt in (((), True), (("--no-generation-prompt",), False)):
        proc = light_prefillq("submit", "--redis", redis_server, "--model", "m",
                              "--messages-file", str(path), *extra, blocked=light)
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.split()[-1]
        record = JobRecord.from_hash(job_id, r.hgetall(keys.job(job_id)))
        assert record.messages == chat and record.prompt is None and record.tokens is None
        assert record.add_generation_prompt is generation_prompt


def test_a_bad_messages_file_is_a_one_line_error(redis_server, tmp_path):
    import redis

    redis.Redis.from_url(redis_server).hset(keys.MODELS, "m", packb(
        {"vocab_size": 100, "context_length": 64, "architecture": "gemma3", "sha256": "0" * 64}))
    cases = {
        "{": "--messages-file must hold a JSON array of",
        '{"role": "user", "content": "Hi"}': "--messages-file must hold a JSON array of",
        '[{"role": "user"}]': "messages[0] must be a dict with keys role and content",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.json"
        path.write_text(text)
        proc = light_prefillq("submit", "--redis", redis_server, "--model", "m",
                              "--messages-file", str(path))
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("prefillq: error: ") and message in lines[0]
    both = light_prefillq("submit", "--redis", redis_server, "--prompt", "x",
                          "--messages-file", str(path))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_serve_needs_only_the_gateway_extra_and_says_so_without_it():
    helped = light_prefillq("serve", "--help")
    assert helped.returncode == 0 and "--api-key" in helped.stdout
    proc = light_prefillq("serve", "--port", "1", blocked=("model", *WORKER_EXTRA, "fastapi"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "prefillq: error: `prefillq serve` needs the gateway extra (missing fastapi): "
        "pip install 'prefillq[gateway]'"]


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The one stderr line of a command that failed with exit status 2."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("prefillq: error: ")
    return lines[0]


def test_usage_errors_are_one_line_without_the_usage_block():
    cases = {
        ("submit", "--prompt", "a", "--top-k", "x"): "argument --top-k: invalid int value: 'x'",
        ("status",): "the following arguments are required: job",
        ("result", "job", "--wait", "-1"): "argument --wait: want a number of seconds >= 0",
        ("result", "job", "--wait", "nan"): "argument --wait: want a number of seconds >= 0",
        ("bogus",): "argument command: invalid choice: 'bogus'",
    }
    for args, message in cases.items():
        line = one_line_error(light_prefillq(*args))
        assert message in line and "usage:" not in line
        assert line.endswith(f"(see `prefillq{' ' + args[0] if args[0] != 'bogus' else ''} "
                             "--help`)")


def test_a_corrupt_record_and_undecodable_input_are_one_line_errors(redis_server):
    import redis

    r = redis.Redis.from_url(redis_server)
    r.flushall()
    r.hset(keys.MODELS, "m", packb({"vocab_size": 100, "context_length": 64,
                                    "architecture": "gemma3", "sha256": "0" * 64}))
    r.hset(keys.job("junk"), mapping={"model": "m", "state": "queued", "cursor": "ten"})
    for command in ("status", "result"):
        line = one_line_error(light_prefillq(command, "--redis", redis_server, "junk"))
        assert "job junk's record cannot be decoded: cursor" in line
    for command in ("status", "cancel", "result"):
        line = one_line_error(light_prefillq(command, "--redis", redis_server, "nope"))
        assert line == "prefillq: error: no job 'nope' (never submitted, or expired)"
    # bytes that are not UTF-8 on the command line reach Python as lone surrogates
    code = ("import sys\nfrom worker.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    for args, message in (
            ([b"submit", b"--redis", redis_server.encode(), b"--model", b"m", b"--prompt",
              b"caf\xe9"], "prompt is not valid text: '\\udce9' at index 3"),
            ([b"status", b"--redis", redis_server.encode(), b"\xff"], "no job '\\udcff'")):
        proc = subprocess.run([sys.executable.encode(), b"-c", code.encode(), *args],
                              capture_output=True, text=True, timeout=60)
        assert message in one_line_error(proc)


def test_file_inputs_name_what_is_wrong_in_one_line(tmp_path):
    floats, latin = tmp_path / "ids.json", tmp_path / "prompt.txt"
    floats.write_text("[2, 1.5]")
    latin.write_bytes(b"caf\xe9")
    proc = light_prefillq("submit", "--redis", "redis://127.0.0.1:1/0", "--tokens-file",
                          str(floats))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "prefillq: error: tokens[1] must be an integer, got float 1.5"]
    proc = light_prefillq("submit", "--redis", "redis://127.0.0.1:1/0", "--prompt-file",
                          str(latin))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"prefillq: error: --prompt-file {latin} is not UTF-8 "
                                   "text: byte 3 (0xe9) unexpected end of data")
