"""`over_llama_cpp`: our prefill against llama.cpp's on the same GGUF, prompt and threads.

llama.cpp runs through llama-cpp-python, built from source by `make bench-llama` into a
benchmark-only venv, in a child process (`bench/llama_cpp_runner.py`) that loads the model
once and then waits on stdin, so the two sides alternate run by run without sharing a core.
llama.cpp computes on the GGUF's quantized blocks with its own CPU kernels; we dequantize at
load and use MLX + OpenBLAS. Both are what a user of each gets on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from model.planner import DEFAULT_CHUNK_TOKENS
from model.registry import LoadedModel

from .common import Recorder, log, prompt_ids
from .prefill import prefill_seconds, top1

RUNNER = Path(__file__).with_name("llama_cpp_runner.py")
# llama.cpp's own defaults (llama-server, llama-cli): logical batch 2048, micro-batch 512.
N_BATCH, N_UBATCH = 2048, 512


class LlamaCpp:
    """One llama.cpp model in a child process; `run()` times one prefill of the prompt.

    Raises:
        RuntimeError: the child failed to load the model or died (its stderr is included).
    """

    def __init__(self, python: Path, gguf: Path, ids: list[int], threads: int, flash: bool):
        n_ctx = -(-len(ids) // 256) * 256
        # -I: not this directory on sys.path (bench/queue.py would shadow the stdlib's)
        argv = [str(python), "-I", str(RUNNER), str(gguf), str(n_ctx), str(threads), str(N_BATCH),
                str(N_UBATCH), "1" if flash else "0"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.info = self._reply()

    def _reply(self) -> dict:
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"llama.cpp runner exited: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def over_llama_cpp(rec: Recorder, loaded: LoadedModel, n: int, repeats: int,
                   python: Path) -> None:
    """Record our prefill tokens/s over llama.cpp's, with flash attention off and on.

    The ratio is taken against the faster llama.cpp setting. Each llama.cpp run is
    interleaved with one of ours; the minimum of each side is kept (`bench.common.timed`).
    """
    ids = prompt_ids(n, loaded.name)
    threads = len(os.sched_getaffinity(0))
    ours_times, theirs = [], {}
    our_top1 = top1(loaded, ids)
    for flash in (False, True):
        log(f"ours vs llama.cpp (flash_attn={flash}), {n} tokens, {repeats} alternating runs")
        child = LlamaCpp(python, loaded.path, ids, threads, flash)
        try:
            runs = []
            for _ in range(repeats):
                ours_times.append(prefill_seconds(loaded, ids, None)[0])
                runs.append(child.run())
        finally:
            child.close()
        theirs[flash] = min(r["seconds"] for r in runs), runs[-1]["top1"], child.info
    ours = min(ours_times)
    flash = min(theirs, key=lambda k: theirs[k][0])
    seconds, their_top1, info = theirs[flash]
    rec("over_llama_cpp", seconds / ours, "ratio", model=loaded.name, n_tokens=n,
        threads=threads,
        ours_tok_s=round(n / ours, 1), llama_cpp_tok_s=round(n / seconds, 1),
        llama_cpp_tok_s_flash_off=round(n / theirs[False][0], 1),
        llama_cpp_tok_s_flash_on=round(n / theirs[True][0], 1), llama_cpp_flash_attn=flash,
        n_batch=N_BATCH, n_ubatch=N_UBATCH, chunk_tokens=DEFAULT_CHUNK_TOKENS,
        top1_equal=our_top1 == their_top1, llama_cpp_python=info["llama_cpp_python"],
        repeats=repeats)
