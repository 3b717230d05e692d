"""Run the docs' examples as written: a page's fenced ``sh``, ``bash`` and ``python`` blocks
in order, as one bash script against a real redis-server (a ``text`` or ``json`` block right
after one is what it prints). `SESSIONS` says which pages each test runs and `NOT_RUN` the
few blocks no test runs, each with its reason; `tests/docs/test_coverage.py` holds every
runnable block to one of them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)
RUNNABLE = {"sh", "bash", "python"}
DOCS_REDIS, DOCS_PORT = "redis://localhost:6379/0", 8000

# the pages each test runs, in order, as one script: one Redis and one worker per session
SESSIONS = {
    # operations.md's first block starts the Redis and the Gemma 3 worker the rest use
    "gemma3": ["docs/operations.md", "README.md", "docs/client.md", "docs/sessions.md",
               "docs/gateway.md"],
    "smollm2": ["docs/models.md"],
}

# (page, the block's first line): why no test runs it
NOT_RUN = {
    ("README.md", "make run    # creates .venv, installs, prefills a sample prompt on the "
                  "real Gemma 3 270M"):
        "`make test` is the whole suite (~15 min); both pip-install into .venv when it is "
        "missing or older than pyproject.toml",
    ("docs/benchmarks.md", "d=$(mktemp -d) && pip download --no-deps --only-binary=:all: "
                           "--python-version 3.12 \\"):
        "downloads wheels from PyPI for the lent GPU",
    ("docs/lm-eval.md", "prefillq serve --redis redis://localhost:6379/0 --score-with-bos"):
        "needs lm-eval (not a prefillq dependency); TASK is a placeholder",
    ("docs/lm-eval.md", "mkdir -p capitals && cd capitals"):
        "needs lm-eval (not a prefillq dependency); tests/integration/test_gateway_lm_eval.py "
        "sends its requests",
    ("docs/operations.md", "export PREFILLQ_REDIS_URL='rediss://alice:PASSWORD@"
                           "redis.internal:6380/0?ssl_ca_certs=/etc/prefillq/ca.pem'"):
        "needs a TLS Redis with ACL users; tests/reliability/test_redis_auth.py runs these URLs",
}


@dataclass(frozen=True)
class Block:
    """A fenced block: its page, the line of its opening fence, its language and its text
    (dedented, for a block inside a list item)."""

    page: str
    line: int
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of `page` (a path under the repository root), in order."""
    text = (ROOT / page).read_text()
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(2),
                  textwrap.dedent(m.group(3)))
            for m in FENCE.finditer(text)]


def session_blocks(name: str) -> list[Block]:
    """The blocks of session `name`'s pages, in order, without those in `NOT_RUN`."""
    return [b for page in SESSIONS[name] for b in page_blocks(page)
            if (b.page, b.first_line) not in NOT_RUN]


def output_of(blocks: list[Block], block: Block) -> Block | None:
    """The ``text`` or ``json`` block right after `block` in `blocks` (what it prints), if
    any."""
    i = blocks.index(block)
    after = blocks[i + 1] if i + 1 < len(blocks) else None
    return after if after is not None and after.lang in ("text", "json") else None


def as_run(text: str, redis_port: int, port: int) -> str:
    """`text` pointed at the test's Redis (on `redis_port`) and gateway port: the docs'
    ``redis://localhost:6379/0`` and port 8000 become the test's own server and a free
    port, and a block's ``redis-server &`` starts that server."""
    return (text.replace(DOCS_REDIS, f"redis://localhost:{redis_port}/0")
            .replace("redis-server &", f"redis-server --port {redis_port} --save '' "
                                       "--appendonly no --logfile redis.log &")
            .replace(f"localhost:{DOCS_PORT}", f"localhost:{port}")
            .replace(f"127.0.0.1:{DOCS_PORT}", f"127.0.0.1:{port}")
            .replace(f"--port {DOCS_PORT}", f"--port {port}"))


def script_of(blocks: list[Block], redis_port: int, port: int) -> str:
    """One bash script running the runnable blocks in order (a python block as a heredoc),
    every background job killed on exit, and a marker line after each block so its output
    can be told apart."""
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for i, block in enumerate(blocks):
        text = as_run(block.text, redis_port, port)
        if block.lang in ("sh", "bash"):
            lines.append(text)
        elif block.lang == "python":
            lines.append(f"python - <<'PREFILLQ_EXAMPLE'\n{text}PREFILLQ_EXAMPLE")
        else:
            continue
        lines.append(f"echo; echo '--- block {i} done'")
    return "\n".join(lines) + "\n"


class Script:
    """`script_of(blocks)` running in `cwd` (where ``.venv`` links to this interpreter's
    environment) from construction on, in a process group of its own; `printed` waits for
    it, so several can run at once. ``prefillq``, ``python`` and ``.venv/bin/prefillq`` are
    this interpreter's, and ``PYTHONPATH`` is this checkout, so a worktree runs its own
    code."""

    def __init__(self, blocks: list[Block], redis_port: int, port: int, cwd: Path):
        venv = cwd / ".venv"
        if not venv.exists():
            venv.symlink_to(Path(sys.executable).parent.parent)
        env = {**os.environ, "PYTHONPATH": str(ROOT),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.blocks = blocks
        self.proc = subprocess.Popen(["bash", "-c", script_of(blocks, redis_port, port)],
                                     cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._printed: dict[Block, str] | None = None

    def printed(self, timeout: float = 600) -> dict[Block, str]:
        """What each runnable block printed. Raises AssertionError with the output if the
        script fails, and kills it and its children after `timeout` seconds."""
        if self._printed is None:
            try:
                stdout, stderr = self.proc.communicate(timeout=timeout)
            finally:
                self.kill()
            assert self.proc.returncode == 0, \
                f"exit {self.proc.returncode}\n{stdout}\n{stderr[-6000:]}"
            self._printed = split_printed(self.blocks, stdout)
        return self._printed

    def kill(self) -> None:
        """Kill the script and every background job its blocks started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def split_printed(blocks: list[Block], stdout: str) -> dict[Block, str]:
    """`stdout` of `script_of(blocks)` cut at its markers: what each block printed."""
    printed, current = {}, []
    for line in stdout.splitlines():
        marker = re.fullmatch(r"--- block (\d+) done", line)
        if marker:
            printed[blocks[int(marker.group(1))]] = "\n".join(current).strip()
            current = []
        else:
            current.append(line)
    return printed


def find(blocks: list[Block], page: str, starts: str) -> Block:
    """The block of `page` in `blocks` whose text starts with `starts`."""
    (block,) = [b for b in blocks if b.page == page and b.text.startswith(starts)]
    return block
