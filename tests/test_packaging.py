"""What ``pip install prefillq`` installs: the four packages with their data files (CUDA
sources, chat templates, ``py.typed``), never the benchmarks or their results, which run
from a checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_packages_and_not_the_benchmarks(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("prefillq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"jobs", "worker", "model", "tokentext"}
    assert not [n for n in names if n.endswith((".jsonl", ".png"))]
    for data in ("jobs/py.typed", "model/kernels/flash_attention.cu",
                 "model/tokenizer/templates/gemma3.jinja"):
        assert data in names, data
