"""A throwaway ``redis-server`` child process, for the tests and the benchmarks.

A real server, as users run one: integration tests and queue benchmarks never stand in
fakeredis for it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

# `start` waits this long for the server to answer PING.
START_TIMEOUT_S = 10.0


def calls_by_command(commandstats: dict) -> dict[str, int]:
    """Calls per command in an ``INFO commandstats`` reply (a command a Lua script runs
    counts too), without INFO itself."""
    return {name.removeprefix("cmdstat_"): s["calls"] for name, s in commandstats.items()
            if name != "cmdstat_info"}


def command_calls(conn: redis.Redis) -> dict[str, int]:
    """`calls_by_command` since the server started."""
    return calls_by_command(conn.info("commandstats"))


def calls_since(conn: redis.Redis, before: dict[str, int]) -> dict[str, int]:
    """`command_calls` now minus `before`, only the commands that were called."""
    after = command_calls(conn)
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def cpu_seconds(conn: redis.Redis) -> float:
    """CPU seconds the server has used since it started, system plus user (``INFO cpu``)."""
    cpu = conn.info("cpu")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"]


def _dies_with_this_process(args: list[str]) -> list[str]:
    """`args` run under ``setpriv --pdeathsig KILL`` where that applies (Linux, setpriv
    installed, called from the main thread: the kernel sends the signal when the thread
    that forked the child exits), else as they are."""
    setpriv = shutil.which("setpriv")
    if (sys.platform != "linux" or setpriv is None
            or threading.current_thread() is not threading.main_thread()):
        return args
    return [setpriv, "--pdeathsig", "KILL", *args]


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS ``redis-server``: its certificate and key, and the CA that
    signed the certificate (the one clients trust, ``?ssl_ca_certs=`` in their URL)."""

    cert: Path
    key: Path
    ca: Path


class RedisServer:
    """``redis-server`` on a free port; restartable on the same port and data directory.

    Use as a context manager (start, then kill) or call `start` / `stop`.

    Args:
        workdir: its data directory (default: a temporary one, removed on `stop`).
        appendonly: AOF persistence with fsync on every write, so a restart keeps the data.
        args: further ``redis-server`` options, e.g. ``["--maxmemory", "10mb"]``.
        password: the default user's password (``--requirepass``).
        users: ACL users by name, each with its password and every right
            (``--user NAME on >PASSWORD ~* &* +@all``).
        tls: serve TLS only, with these files (``--tls-port``; clients are not asked for a
            certificate); `url` is then ``rediss://...?ssl_ca_certs=CA``.
    Raises:
        RedisServerError: the binary is not installed (``apt-get install redis-server``).
    """

    def __init__(self, workdir: str | Path | None = None, appendonly: bool = False,
                 args: list[str] | None = None, *, password: str | None = None,
                 users: dict[str, str] | None = None, tls: TLSFiles | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerError("redis-server is not installed (apt-get install redis-server)")
        self._tmp = tempfile.TemporaryDirectory() if workdir is None else None
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)
        self.appendonly, self.extra = appendonly, list(args or [])
        self.password, self.users, self.tls = password, dict(users or {}), tls
        self.port = free_port()
        self.url = self.url_as(None, password)
        self.proc: subprocess.Popen | None = None

    def url_as(self, user: str | None, password: str | None) -> str:
        """This server's URL (db 0) with `user` and `password` in it (either may be None)."""
        auth = ""
        if user is not None or password is not None:
            auth = (quote(user or "", safe="") + (":" + quote(password, safe="")
                    if password is not None else "") + "@")
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"

    def _args(self) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--dir", str(self.workdir)]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                     "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                     "--tls-ca-cert-file", str(self.tls.ca)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        for user, password in self.users.items():
            args += ["--user", user, "on", f">{password}", "~*", "&*", "+@all"]
        args += (["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly
                 else ["--appendonly", "no"])
        return args + self.extra

    def start(self) -> RedisServer:
        """Start the server and wait until it answers. Raises RedisServerError.

        On Linux, started from the main thread, the server gets a parent-death signal
        (SIGKILL, through util-linux's ``setpriv --pdeathsig``), so a test run or benchmark
        killed before its cleanup runs (SIGTERM, SIGKILL, a timeout) leaves no server behind.
        The signal follows the thread that started it, hence the main thread only.
        """
        self.proc = subprocess.Popen(_dies_with_this_process(self._args()),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        """Kill the server (SIGKILL: nothing is saved beyond what AOF already wrote)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
