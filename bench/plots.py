"""PNG plots of a bench run (matplotlib), plus the raw records as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def write_plots(records: list[dict], context: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"context": context, "records": records},
                                                 indent=1))
    title = f"{context['date']} {context['commit']} {context['device']}"
    written = []
    for metric, x_key, xlabel, name in (
        ("tok_s_vs_prompt_length", "n_tokens", "prompt length (tokens)", "prompt_length"),
        ("tok_s_vs_chunk_size", "chunk_tokens", "chunk size (tokens)", "chunk_size"),
    ):
        rows = [r for r in records if r["metric"] == metric]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r[x_key] for r in rows], [r["value"] for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("prefill tokens/s")
        ax.set_title(f"Gemma 3 270M prefill, {title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        path = out / f"tok_s_vs_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    short = [r for r in records if r["metric"] == "short_wait_over_chunk_time"]
    if short:
        r = short[0]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh(["mean wait", "max wait", "ceiling"],
                [r["value"], r["max_wait_chunks"], r["ceiling"]],
                color=["tab:blue", "tab:orange", "tab:gray"])
        ax.set_xlabel(f"extra latency of a short job, in long-job chunks ({r['long_chunk_s']} s)")
        ax.set_title(f"short job under a {r['n_long']}-token prefill, {title}", fontsize=9)
        path = out / "short_job_latency.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
