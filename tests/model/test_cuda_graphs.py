"""`model.runtime.cuda_graphs`: MLX's CUDA graph knobs get prefillq's defaults unless the
environment sets them, and importing `model` applies them."""

from __future__ import annotations

import os
import subprocess
import sys

from model.runtime import cuda_graphs


def test_unset_knobs_get_the_defaults_and_set_ones_are_kept():
    env = {"MLX_MAX_OPS_PER_BUFFER": "20"}
    assert cuda_graphs.configure(env) == {"MLX_MAX_OPS_PER_BUFFER": "20",
                                          "MLX_CUDA_GRAPH_CACHE_SIZE": "2000",
                                          "MLX_CUDA_SDPA_CACHE_SIZE": "8192"}
    assert env["MLX_CUDA_GRAPH_CACHE_SIZE"] == "2000"


def test_importing_model_sets_them_before_mlx_runs_anything():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    code = "import os, model; print(os.environ['MLX_MAX_OPS_PER_BUFFER'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == cuda_graphs.DEFAULTS["MLX_MAX_OPS_PER_BUFFER"]
