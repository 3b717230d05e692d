"""The client commands of the CLI run from an install without MLX (a web backend's)."""

from __future__ import annotations

import json
import subprocess
import sys

from jobs import keys
from jobs.serializer import packb

# Runs `prefillq ARGS` with the worker's heavy packages made unimportable.
BLOCKED = ("mlx", "numpy", "model", "tqdm", "fakeredis", "gguf", "tokenizers")
LIGHT = (
    "import sys\n"
    f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
    "from worker.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def light_prefillq(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LIGHT, *args], capture_output=True, text=True,
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
    assert cancel.returncode == 0 and "cancel requested" in cancel.stdout

    result = light_prefillq("result", "--redis", redis_server, job_id)
    assert result.returncode == 1 and "canceled" in result.stderr

    reap = light_prefillq("reap", "--redis", redis_server)
    assert reap.returncode == 0 and "reaped 0 jobs" in reap.stdout


def test_the_light_client_refuses_a_bad_request_in_one_line(redis_server):
    proc = light_prefillq("submit", "--redis", redis_server, "--model", "nope", "--prompt", "x")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "no registered worker serves model 'nope'" in proc.stderr
