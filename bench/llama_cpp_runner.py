"""llama.cpp's prefill, driven line by line from `bench.llama_cpp` (runs in its own venv).

    python bench/llama_cpp_runner.py MODEL.gguf N_CTX N_THREADS N_BATCH N_UBATCH FLASH_ATTN

It imports only llama-cpp-python and the standard library: it runs under the
benchmark-only interpreter that `make bench-llama` builds, never under prefillq's own.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    """Protocol (JSON lines): stdin gets one line with the prompt's token ids, then one line per
    run (any content); after loading it prints ``{"ready": true, ...}`` and after each run
    ``{"seconds": float, "top1": int}``. It exits at end of input. The prompt is evaluated with
    `Llama.eval` (batches of N_BATCH tokens, each decoded in N_UBATCH-token micro-batches) on an
    emptied KV cache; the seconds cover the decode calls only, as our side's cover the chunks.
    """
    import llama_cpp
    import numpy as np

    path, n_ctx, n_threads, n_batch, n_ubatch, flash = argv
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=int(n_ctx), n_threads=int(n_threads),
        n_threads_batch=int(n_threads), n_batch=int(n_batch), n_ubatch=int(n_ubatch),
        flash_attn=flash == "1", verbose=False,
    )
    ids = json.loads(sys.stdin.readline())
    print(json.dumps({"ready": True, "llama_cpp_python": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode()}),
          flush=True)
    for _ in sys.stdin:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        llama_cpp.llama_synchronize(llm._ctx.ctx)
        seconds = time.perf_counter() - t0
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                       shape=(llm.n_vocab(),))
        print(json.dumps({"seconds": seconds, "top1": int(logits.argmax())}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
