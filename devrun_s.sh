set -e
cat /root/stash/part.aa .device/b/part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
pip install -q --no-index --no-deps --target /root/site /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .device/py312/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=/root/site:$PWD
python - <<'PY' 2>&1 | grep -v "^WARN"
import os, mlx.core as mx
from pathlib import Path
import model
from bench.common import Recorder
from bench import gpu_deepseek4
rec = Recorder(True, {"date": "2026-12-01", "commit": "a5af0b4+experts_sweep (working tree)", "mlx": mx.__version__,
                      "device": str(mx.default_device())}, Path(os.environ["OUT"]) / "sweep-small.jsonl")
gpu_deepseek4.experts_sweep(rec, [(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (32, 0), (2048, 0), (2048, 384), (2048, 768)])
PY
