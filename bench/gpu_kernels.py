"""Where a GPU prefill's device time goes, kernel by kernel: one prefill under Nsight Compute.

    python -m bench.gpu_kernels [--model gemma3-4b] [--layers 6] [--tokens 32768]
                                [--chunk 2048] [--out FILE]

A child process builds the model (random bf16 weights at `bench.gpu.MODELS` shapes, the
first `--layers` layers: Gemma 3's six keep its five-local-one-global pattern), runs a
warm-up prefill, and runs one more between ``cuProfilerStart`` and ``cuProfilerStop`` under
``ncu --profile-from-start off --metrics gpu__time_duration.sum`` (each kernel's own
duration; caches and clocks left alone); this process sums the durations by kernel and by
kind (`kernel_kind`). ncu runs kernels one at a time, so their sum can exceed the
unprofiled prefill's wall time (another child, fastest of 3 after a warm-up) where MLX's
CUDA graphs run independent kernels side by side: shares are of the summed kernel time.
Needs ``ncu`` on the PATH (the lent GPUs have it) and the CUDA driver's ``libcuda.so.1``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import io
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

from .common import Recorder, bench_parser, git_commit, log, refuse_existing

KINDS = (  # (kind, substrings of the kernel's function name), the first match wins
    ("attention", ("prefillq_fa", "prefillq_flash", "prefillq_sparse", "flash", "sdpa",
                   "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "gemv")),
    ("norm", ("rms_norm", "layer_norm")),
    ("rope", ("rope",)),
    ("reduction", ("reduce", "softmax", "logsumexp", "arg_")),
    ("copy", ("copy", "gather", "scatter", "slice", "concat")),
    # MLX names a compiled graph's kernel by its ops (GELU's: ...MultiplyPower...Tanh...);
    # `model.kernels.gelu`'s is custom_kernel_prefillq_gelu_gate_...
    ("elementwise", ("unary", "binary", "ternary", "compiled", "fused", "multiply", "tanh",
                     "broadcast", "gelu")),
)
SECONDS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3,
           "ms": 1e-3, "second": 1.0, "s": 1.0}


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its function name (`KINDS`; ``other`` if none)."""
    lower = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lower for p in parts)), "other")


def kernel_seconds(report: str) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches, seconds)}`` from ncu's ``--csv`` report of the
    ``gpu__time_duration.sum`` metric (lines before the header, ncu's own, are skipped).

    Raises:
        ValueError: no ``"ID"`` header line, or a duration in a unit not in `SECONDS`.
    """
    lines = report.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("not an ncu --csv report: no \"ID\" header line")
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row["Metric Unit"]
        if unit not in SECONDS:
            raise ValueError(f"duration unit {unit!r} is not one of {sorted(SECONDS)}")
        total = totals[row["Kernel Name"]]
        total[0] += 1
        total[1] += float(row["Metric Value"].replace(",", "")) * SECONDS[unit]
    return {name: (n, s) for name, (n, s) in totals.items()}


def by_kind(kernels: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    """`kernel_seconds`' totals summed by `kernel_kind`, slowest first."""
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, (n, s) in kernels.items():
        total = kinds[kernel_kind(name)]
        total[0] += n
        total[1] += s
    return {k: (n, s) for k, (n, s) in sorted(kinds.items(), key=lambda kv: -kv[1][1])}


def _prefill(model: str, layers: int, tokens: int, chunk: int, repeats: int,
             profiled: bool) -> float:
    """Build the model, run a warm-up prefill, then `repeats` more (with `profiled`, one,
    between ``cuProfilerStart`` and ``cuProfilerStop``: ncu runs with
    ``--profile-from-start off``, so the build's and warm-up's kernels stay out); the
    fastest's wall seconds."""
    from .gpu import MODELS, one_prefill_seconds

    net = MODELS[model].build(n_layers=layers)
    one_prefill_seconds(net, tokens, chunk)
    if not profiled:
        return min(one_prefill_seconds(net, tokens, chunk) for _ in range(repeats))
    import mlx.core as mx

    driver = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    driver.cuProfilerStart()
    seconds = one_prefill_seconds(net, tokens, chunk)
    mx.synchronize()
    driver.cuProfilerStop()
    return seconds


def _child(args, repeats: int, ncu: list[str] = ()) -> str:
    cmd = [*ncu, sys.executable, "-m", "bench.gpu_kernels", "--prefill", str(repeats),
           *(["--profiled"] if ncu else []),
           "--model", args.model, "--layers", str(args.layers), "--tokens", str(args.tokens),
           "--chunk", str(args.chunk)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.gpu_kernels", __doc__, json_lines=False)
    from .gpu import MODELS

    p.add_argument("--model", default="gemma3-4b", choices=sorted(MODELS),
                   help="bench.gpu's MODELS (default %(default)s)")
    p.add_argument("--layers", type=int, default=6, help="the first N layers (default %(default)s)")
    p.add_argument("--tokens", type=int, default=32_768)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefill", type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prefill:  # a child: N prefills, the fastest's seconds on stdout
        print(_prefill(args.model, args.layers, args.tokens, args.chunk, args.prefill,
                       args.profiled))
        return 0
    refuse_existing(p, args.out)
    ncu = shutil.which("ncu")
    if ncu is None:
        p.error("ncu (Nsight Compute) is not on the PATH")
    case = {"model": args.model, "layers": args.layers, "n_tokens": args.tokens,
            "chunk_tokens": args.chunk}
    rec = Recorder(True, {"date": datetime.date.today().isoformat(), "commit": git_commit(),
                          "ncu": ncu,
                          "mlx_env": {k: v for k, v in os.environ.items()
                                      if k.startswith("MLX_")}}, args.out)
    wall = float(_child(args, 3).split()[-1])
    log(f"unprofiled prefill {wall:.4f} s; profiling one under ncu")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "kernels.csv")
        _child(args, 1, [ncu, "--csv", "--metrics", "gpu__time_duration.sum",
                         "--profile-from-start", "off",
                         "--cache-control", "none", "--clock-control", "none",
                         "--print-kernel-base", "function", "--log-file", report])
        with open(report) as f:
            kernels = kernel_seconds(f.read())
    device = sum(s for _, s in kernels.values())
    rec("prefill_wall_seconds", wall, "s", **case)
    rec("kernel_seconds", device, "s", **case, launches=sum(n for n, _ in kernels.values()),
        share_of_wall=round(device / wall, 3))
    for kind, (n, s) in by_kind(kernels).items():
        rec("kernel_kind_seconds", s, "s", **case, kind=kind, launches=n,
            share_of_kernels=round(s / device, 3), share_of_wall=round(s / wall, 3))
    for name, (n, s) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]:
        rec("kernel_name_seconds", s, "s", **case, kernel=name[:160], kind=kernel_kind(name),
            launches=n, share_of_kernels=round(s / device, 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
