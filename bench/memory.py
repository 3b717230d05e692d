"""RSS growth of a long prefill against the cache plan (run in a fresh process).

    python -m bench.memory N_TOKENS   # prints one JSON object
"""

from __future__ import annotations

import json
import subprocess
import sys

from .common import Recorder, log

F32 = 4


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def chunk_activation_bytes(args, chunk: int, n_tokens: int) -> dict[str, int]:
    """Peak float32 intermediates of one chunk (an estimate; MLX frees as it goes).

    The largest term is the attention of a global layer in the last chunk: MLX's CPU
    attention materializes scores and probabilities, heads x chunk x n_tokens each. A
    layer's MLP (gate, up, product: chunk x ffn each) runs after its attention, so the peak
    is the larger of the two, plus the chunk's hidden, q, k, v rows.
    """
    attention = 2 * args.num_attention_heads * chunk * n_tokens * F32
    mlp = 3 * chunk * args.intermediate_size * F32
    rows = chunk * (4 * args.hidden_size + 2 * args.num_attention_heads * args.head_dim
                    + 2 * args.num_key_value_heads * args.head_dim) * F32
    return {"attention": attention, "mlp": mlp, "rows": rows,
            "total": max(attention, mlp) + rows}


def measure(model: str, n_tokens: int) -> dict:
    from model.planner import DEFAULT_CHUNK_TOKENS
    from model.registry import load_model

    from .common import prompt_ids

    loaded = load_model(model)
    ids = prompt_ids(n_tokens)
    prefill = loaded.start_prefill(ids)
    rss_after_load = _status_kb("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    prefill.run()
    peak = _status_kb("VmHWM") * 1024
    plan = prefill.cache.plan(n_tokens)
    chunk = min(DEFAULT_CHUNK_TOKENS, n_tokens)
    activations = chunk_activation_bytes(loaded.model.args, chunk, n_tokens)
    return {"rss_after_load": rss_after_load, "peak_rss": peak,
            "planned_kv": plan.resident_bytes, "activations": activations}


def rss_growth_over_plan(rec: Recorder, model: str, n_tokens: int) -> None:
    log(f"RSS growth of a {n_tokens}-token prefill (fresh process)")
    proc = subprocess.run([sys.executable, "-m", "bench.memory", model, str(n_tokens)],
                          capture_output=True, text=True, check=True)
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = m["peak_rss"] - m["rss_after_load"]
    planned = m["planned_kv"] + m["activations"]["total"]
    rec("rss_growth_over_plan", growth / planned, "ratio", n_tokens=n_tokens,
        growth_mb=round(growth / 2**20, 1), planned_kv_mb=round(m["planned_kv"] / 2**20, 1),
        activation_estimate_mb=round(m["activations"]["total"] / 2**20, 1),
        rss_after_load_mb=round(m["rss_after_load"] / 2**20, 1), ceiling=1.5)


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
