"""The `prefillq` command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from model.runtime.blas import find_blas, openblas_coretype


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
    assert proc.stderr.strip() == (
        "prefillq: error: no job 'no-such-job' (never submitted, or expired)")


def test_bad_model_or_settings_fail_in_one_line_before_any_load():
    proc = prefillq("run", "--model", "nope", "--quiet")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "prefillq: error: unknown model 'nope'")
    assert "Traceback" not in proc.stderr
    proc = prefillq("run", "--chunk-tokens", "0", "x")
    assert proc.returncode == 2 and "loading" not in proc.stderr
    assert "--chunk-tokens: want an integer >= 1, got '0'" in proc.stderr
    proc = prefillq("run", "--quiet", env={**os.environ, "PREFILLQ_CPU_STREAMS": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "prefillq: error: PREFILLQ_CPU_STREAMS='0': want a positive integer")


def test_bench_refuses_a_bad_model_and_an_existing_results_file(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text("{}\n")
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "exists; results files are never overwritten" in proc.stderr
    assert out.read_text() == "{}\n"
    proc = subprocess.run([sys.executable, "-m", "bench.profile", "--model", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown model 'nope'" in proc.stderr
    # the suite's prompts are Gemma's ids: another model only with --ratios-only
    for extra, says in ((["--model", "smollm2-135m"], "another model runs with --ratios-only"),
                        (["--model", "llama-tiny", "--ratios-only"],
                         "no llama.cpp reference prompt")):
        proc = subprocess.run([sys.executable, "-m", "bench", "--quick", *extra],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr.splitlines()[-1], proc.stderr


def test_unreachable_redis_is_a_one_line_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = prefillq("status", "--redis", f"redis://127.0.0.1:{port}/0", "abc")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefillq: error: cannot reach Redis")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_entry_point_preloads_an_optimized_blas():
    blas = find_blas()
    assert blas is not None, "libopenblas0-pthread is not installed"
    dropped = ("LD_PRELOAD", "PREFILLQ_BLAS_REEXEC", "OPENBLAS_CORETYPE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    code = (
        "import os; from model.runtime.blas import ensure_blas, loaded_blas; ensure_blas(); "
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


def test_plan_deepseek4_flash_without_weights():
    proc = prefillq("plan", "--model", "deepseek4-flash", "--context", "131072", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = last_json(proc.stdout)
    assert plan["bytes_per_token"] == 6880  # 21 x (256 + 64) + 20 x 8
    assert (plan["n_layers"], plan["context_length"]) == (43, 131072)
    assert plan["resident_bytes"] == plan["fixed_bytes"] + 6880 * 131072
    assert set(plan) >= {"n_layers", "context_length", "bytes_per_token", "fixed_bytes",
                         "resident_bytes"}


def test_plan_gemma3_from_gguf_metadata():
    proc = prefillq("plan", "--model", "gemma3-270m", "--context", "8192", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = last_json(proc.stdout)
    assert plan["bytes_per_token"] == 3 * 2 * 256 * 2  # 3 global layers, K and V, bf16
    assert plan["fixed_bytes"] == 15 * 512 * 2 * 256 * 2  # 15 rings of 512 rows


def test_run_deepseek4_tiny_chunked_equals_one_pass():
    text = "The number 7 is odd. " * 30
    runs = [last_json(prefillq("run", text, "--model", "deepseek4-tiny", "--json", "--quiet",
                               "--top-k", "3", *extra).stdout)
            for extra in ((), ("--chunk-tokens", "7"))]
    one_pass, chunked = runs
    assert one_pass["state"] == chunked["state"] == "finished"
    assert one_pass["chunks"] == 1 and chunked["chunks"] == -(-chunked["n_tokens"] // 7)
    assert [t["id"] for t in one_pass["top_k"]] == [t["id"] for t in chunked["top_k"]]
    tol = 1e-3 * max(abs(t["logit"]) for t in one_pass["top_k"])
    for a, b in zip(one_pass["top_k"], chunked["top_k"], strict=True):
        assert abs(a["logit"] - b["logit"]) <= tol


def test_run_serves_a_gguf_by_path_under_its_name(tmp_path):
    from model.gguf.synthetic.llama import QWEN3_TINY, write_tiny_llama

    path = write_tiny_llama(tmp_path / "mine.gguf", QWEN3_TINY)
    proc = prefillq("run", "the tiny model", "--model", f"mine={path}", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    record = last_json(proc.stdout)
    assert (record["state"], record["model"]) == ("finished", "mine")
    assert "loaded mine (qwen3, " in proc.stderr
