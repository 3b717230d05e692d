"""The side-by-side ratios (`side_by_side`), from one set of alternating runs on one prompt."""

from __future__ import annotations

import mlx.core as mx

from model.planner import DEFAULT_CHUNK_TOKENS
from model.registry import LoadedModel

from .common import Recorder, interleaved, log, prompt_ids, timed
from .prefill import mlx_lm_twin, prefill_seconds
from .queue import queued_prefill


def side_by_side(rec: Recorder, loaded: LoadedModel, n: int, repeats: int) -> None:
    """Record, for an `n`-token prompt, our chunked prefill over: one pass
    (``chunked_over_one_pass``), mlx-lm's `generate_step` prefill on the same arrays and
    2,048-token steps (``forward_over_mlx_lm``), and a job through a real redis-server and
    the worker loop (``queue_over_in_process``); each side the fastest of `repeats`. The
    four run in turn, so each ratio's sides share the machine's drift.

    Raises:
        ValueError: `n` is not a multiple of 2,048, so our default plan and mlx-lm's steps
            would cut the prompt differently.
    """
    from mlx_lm.generate import generate_step

    ids = prompt_ids(n, loaded.name)
    chunks = loaded.start_prefill(ids).plan.chunk_sizes
    steps = [min(DEFAULT_CHUNK_TOKENS, n - i) for i in range(0, n, DEFAULT_CHUNK_TOKENS)]
    if list(chunks) != steps:
        raise ValueError(f"{n} tokens: default plan {chunks} is not mlx-lm's 2,048-token "
                         "steps; pick a multiple of 2,048")
    theirs_model = mlx_lm_twin(loaded)

    def theirs() -> None:
        for _ in generate_step(mx.array(ids), theirs_model, max_tokens=1,
                               prefill_step_size=DEFAULT_CHUNK_TOKENS):
            break
        mx.clear_cache()

    log(f"chunked vs one pass vs mlx-lm vs queued, {n} tokens, {repeats} alternating runs each")
    non_forward: list[float] = []
    with queued_prefill(loaded) as submit_and_work:

        def queued() -> float:
            timings = submit_and_work(ids).timings
            non_forward.append(timings["prefill_s"] - timings["compute_s"])
            return timings["prefill_s"]

        chunked, one_pass, mlx_lm, queue = interleaved(
            lambda: prefill_seconds(loaded, ids, None)[0],
            lambda: prefill_seconds(loaded, ids, n)[0],
            lambda: timed(theirs)[0],
            queued,
            repeats=repeats)
    per_job = dict(model=loaded.name, n_tokens=n, chunks=len(chunks), repeats=repeats)
    rec("chunked_over_one_pass", one_pass / chunked, "ratio", **per_job,
        chunked_tok_s=round(n / chunked, 1), one_pass_tok_s=round(n / one_pass, 1),
        floor=0.95)
    rec("forward_over_mlx_lm", mlx_lm / chunked, "ratio", **per_job,
        ours_tok_s=round(n / chunked, 1), mlx_lm_tok_s=round(n / mlx_lm, 1),
        chunk_tokens=DEFAULT_CHUNK_TOKENS, floor=0.95)
    # Outside the forward passes, per chunk: RQ and Redis work, plus once per job the final
    # logits over the whole vocabulary, top-k and publish.
    rec("queue_over_in_process", chunked / queue, "ratio", **per_job,
        queue_tok_s=round(n / queue, 1), in_process_tok_s=round(n / chunked, 1),
        non_forward_ms_per_chunk=round(min(non_forward) / len(chunks) * 1e3, 2), floor=0.90)
