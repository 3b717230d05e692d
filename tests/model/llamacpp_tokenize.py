"""Recording llama.cpp's token ids for a test vocabulary with a built ``llama-tokenize``.

The tokenizer tests compare with ids recorded here once (tests/data/*-llamacpp.json); running
them needs no llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from pathlib import Path


def run_llama_tokenize(binary: str, gguf: Path, text: str, *, parse_special: bool) -> list[int]:
    """llama.cpp's ids for `text` (BOS as the vocabulary says), read verbatim from a file."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
    cmd = [binary, "-m", str(gguf), "-f", f.name, "--ids", "--log-disable", "--no-escape"]
    if not parse_special:  # llama-tokenize parses special tokens by default
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    Path(f.name).unlink()
    return json.loads(out.strip().splitlines()[-1])


def llama_cpp_version(binary: str) -> str:
    """The first line ``llama-tokenize --version`` prints (version, build, commit)."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return (done.stdout + done.stderr).strip().splitlines()[0]


def write_reference(path: Path, *, gguf: Path, binary: str, source: str, command: str,
                    cases: list[dict]) -> None:
    """Writes ``{"meta": ..., "cases": [...]}`` (one case per line); the meta records `gguf`'s
    name and sha256, the llama.cpp version, where it came from (`source`) and `command`."""
    meta = {
        "gguf_file": gguf.name,
        "gguf_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
        "llama_cpp_version": llama_cpp_version(binary),
        "llama_cpp_source": source,
        "command": command,
    }
    rows = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    meta_json = json.dumps(meta, ensure_ascii=False, indent=2)
    path.write_text(f'{{"meta": {meta_json},\n "cases": [\n{rows}\n]}}\n', encoding="utf-8")


def read_reference(path: Path) -> dict | None:
    """The reference `write_reference` wrote, or None before it is first generated."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
