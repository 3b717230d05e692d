#!/usr/bin/env bash
# The second of the two device calls that run `python -m bench.gpu` on a lent H200 with
# the MLX wheels carried in .device/ (docs/benchmarks.md, "Running bench.gpu on a lent
# GPU"): join the mlx-cuda-13 wheel from its two parts, install the wheels beside the
# device's own torch and transformers, and run the benchmark with its records in $OUT.
#   bash bench/gpu_run.sh [bench.gpu options, e.g. --deepseek4-layers 0 or --quick]
# BENCH_MODULE=bench.gpu_queue runs another benchmark module the same way; a redis-server
# carried in .device/b/bin (with its libraries in .device/b/lib) is put on the PATH.
# BENCH_NAME names the records (default gpu-h200: $OUT/$BENCH_NAME.jsonl and .log), so one
# device call can run several modules; a machine that already has the wheels installed
# (a later call while it is warm) skips the join and the install.
set -euo pipefail
WHEEL=mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
SHA256=94cb48fba73e5ee39467e51c35c51c691123359ca17bafd1a24cf92ad6732bee
# the run tool's 600 s per command, less the install and the final copy
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-540}
OUT=${OUT:?OUT names the folder whose files come back}

NAME=${BENCH_NAME:-gpu-h200}

if [ ! -f /root/site/.prefillq-installed ]; then
    cat /root/stash/part.aa .device/b/part.ab > "/tmp/$WHEEL"
    echo "$SHA256  /tmp/$WHEEL" | sha256sum -c --quiet -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /root/site "/tmp/$WHEEL" .device/b/wheels/*.whl
    touch /root/site/.prefillq-installed
fi
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
BENCH_MODULE=${BENCH_MODULE:-bench.gpu}
if [ -x .device/b/bin/redis-server ]; then export PATH=$PWD/.device/b/bin:$PATH; fi
python3 -c "import mlx.core as mx, mlx_lm, torch, transformers as t
print(mx.__version__, mx.default_device(), mlx_lm.__version__, torch.__version__,
      t.__version__, torch.cuda.get_device_name())"
set +e  # the records so far come back even when the run fails or overruns
timeout "$BENCH_TIMEOUT_S" python3 -m "$BENCH_MODULE" "$@" --out "$OUT/$NAME.jsonl" 2>&1 \
    | tee "$OUT/$NAME.log"
status=${PIPESTATUS[0]}
echo "$BENCH_MODULE exit status $status; $(grep -c . "$OUT/$NAME.jsonl" 2>/dev/null) lines"
exit "$status"
