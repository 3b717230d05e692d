"""The `prefillq` command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from worker.blas import find_blas, openblas_coretype


def prefillq(*args: str, env: dict | None = None, timeout: int = 300):
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_run_json_on_the_embedded_default(reference_cases):
    proc = prefillq("run", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    record = last_json(proc.stdout)
    case = reference_cases[0]  # the sample prompt, "The capital of France is"
    assert record["state"] == "finished"
    assert record["model"] == "gemma3-270m"
    assert record["n_tokens"] == len(case["tokens"])
    assert record["chunks"] == 1
    assert len(record["job_id"]) == 32
    top = record["top_k"]
    assert [t["piece"] for t in top[:3]] == [" the", " a", " Paris"]
    assert [t["logit"] for t in top] == sorted((t["logit"] for t in top), reverse=True)
    assert all(set(t) == {"id", "logit", "logprob", "piece"} for t in top)
    assert all(t["logprob"] < 0 for t in top)


def test_run_chunk_tokens_from_a_prompt_file(tmp_path, reference_cases):
    case = reference_cases[2]  # 19 tokens of Python
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(case["text"])
    proc = prefillq("run", "--prompt-file", str(prompt), "--chunk-tokens", "5", "--top-k", "3",
                    "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    record = last_json(proc.stdout)
    assert record["n_tokens"] == len(case["tokens"])
    assert record["chunks"] == -(-len(case["tokens"]) // 5)
    assert record["top_k"][0]["id"] == case["top10_ids"][0]
    assert len(record["top_k"]) == 3


def test_bad_input_exits_nonzero_with_a_message(redis_server):
    proc = prefillq("submit", "--redis", redis_server, "--prompt", "   ")
    assert proc.returncode != 0
    assert "prompt is empty" in proc.stderr
    proc = prefillq("status", "--redis", redis_server, "no-such-job")
    assert proc.returncode != 0
    assert "no job" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_entry_point_preloads_an_optimized_blas():
    blas = find_blas()
    assert blas is not None, "libopenblas0-pthread is not installed"
    dropped = ("LD_PRELOAD", "PREFILLQ_BLAS_REEXEC", "OPENBLAS_CORETYPE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    code = (
        "import os; from worker.blas import ensure_blas, loaded_blas; ensure_blas(); "
        "import mlx.core; print(os.environ.get('OPENBLAS_CORETYPE')); "
        "print('\\n'.join(loaded_blas()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    coretype, *mapped = proc.stdout.split()
    assert os.path.realpath(blas) in {os.path.realpath(p) for p in mapped}, mapped
    assert coretype == str(openblas_coretype())


def test_openblas_coretype_follows_cpu_flags():
    def cpuinfo(flags: str) -> str:
        return f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n"

    assert openblas_coretype(cpuinfo("avx2 fma avx512f avx512vl avx512bw avx512dq "
                                     "avx512_bf16")) == "Cooperlake"
    assert openblas_coretype(cpuinfo("avx2 fma avx512f avx512vl avx512bw avx512dq")) == "SkylakeX"
    assert openblas_coretype(cpuinfo("avx2 fma avx512f")) == "Haswell"
    assert openblas_coretype(cpuinfo("avx")) is None
    assert openblas_coretype("") is None
