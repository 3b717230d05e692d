"""Compiling the sm_90a kernels and reading their SASS on a machine without a GPU: NVRTC
and nvdisasm from the test extra's wheels (Linux x86-64), a skip elsewhere."""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model.kernels.nvrtc import NvrtcError, library


def nvrtc_or_skip() -> None:
    """Skip the test where NVRTC is missing (the test extra installs nvidia-cuda-nvrtc)."""
    try:
        library()
    except NvrtcError as e:
        pytest.skip(str(e))


def disassemble(cubin: bytes, tmp_path: Path) -> str:
    """nvdisasm's SASS of `cubin` (nvdisasm from the nvidia-cuda-nvdisasm wheel or the
    PATH; the test is skipped without it)."""
    wheel = Path(sys.prefix) / "lib"
    found = sorted(wheel.glob("python3*/site-packages/nvidia/cu*/bin/nvdisasm"))
    tool = str(found[0]) if found else shutil.which("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed (the test extra brings it on Linux x86-64)")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout


def hgmma_shapes(sass: str) -> dict[str, int]:
    """How many warpgroup MMAs of each shape (``"64x64x16"``) the SASS holds."""
    return dict(collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32\.BF16", sass)))


def spills(sass: str) -> bool:
    """Whether the SASS loads or stores local memory (register spills)."""
    return bool(re.search(r"\b(STL|LDL)\b", sass))
