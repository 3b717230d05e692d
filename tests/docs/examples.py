"""Run a docs page's examples as written: its fenced ``sh`` and ``python`` blocks in order,
as one bash script against a real redis-server (the docs' ``redis://localhost:6379/0`` and
port 8000 point at the test's own server and a free port), with ``prefillq`` and
``python`` from this interpreter's environment. Each ``text`` block after a block is what
that block prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
DOCS_REDIS, DOCS_PORT = "redis://localhost:6379/0", 8000


@dataclass(frozen=True)
class Block:
    """A fenced block: its language and its text."""

    lang: str
    text: str


def section_blocks(page: str, heading: str) -> list[Block]:
    """The fenced blocks of `page` (a path under the repository root) under `heading` (a
    Markdown heading line, e.g. ``### The README's examples on SmolLM2``), up to the next
    heading of the same or a higher level. Raises ValueError if the heading is missing."""
    text = (ROOT / page).read_text()
    level = heading.split(" ", 1)[0]
    start = text.find(f"\n{heading}\n")
    if start < 0:
        raise ValueError(f"{page} has no heading {heading!r}")
    rest = text[start + len(heading) + 2:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    body = rest[:end.start()] if end else rest
    return [Block(m.group(1), m.group(2)) for m in FENCE.finditer(body)]


def script_of(blocks: list[Block], redis_url: str, port: int) -> str:
    """One bash script running the ``sh`` and ``python`` blocks in order (a python block as
    a heredoc), every background job killed on exit, and a marker line after each block
    so its output can be told apart."""
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for i, block in enumerate(blocks):
        text = (block.text.replace(DOCS_REDIS, redis_url)
                .replace(f"localhost:{DOCS_PORT}", f"localhost:{port}")
                .replace(f"--port {DOCS_PORT}", f"--port {port}"))
        if block.lang == "sh":
            lines.append(text)
        elif block.lang == "python":
            lines.append(f"python - <<'PREFILLQ_EXAMPLE'\n{text}PREFILLQ_EXAMPLE")
        else:
            continue
        lines.append(f"echo; echo '--- block {i} done'")
    return "\n".join(lines) + "\n"


def run_blocks(blocks: list[Block], redis_url: str, port: int, cwd: Path,
               timeout: float = 600) -> dict[int, str]:
    """Run `script_of(blocks)` in `cwd`; returns what each block printed, by its index in
    `blocks`. Raises AssertionError with the output if the script fails."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script_of(blocks, redis_url, port)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    printed, current = {}, []
    for line in done.stdout.splitlines():
        marker = re.fullmatch(r"--- block (\d+) done", line)
        if marker:
            printed[int(marker.group(1))] = "\n".join(current).strip()
            current = []
        else:
            current.append(line)
    return printed
