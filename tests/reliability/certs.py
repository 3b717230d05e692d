"""A throwaway certificate authority and a server certificate for 127.0.0.1, made with the
``openssl`` command line, for TLS redis-server tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from worker.redis_server import TLSFiles

# Days the test certificates are valid (they live as long as one test run).
VALID_DAYS = "2"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_tls_files(directory: Path) -> TLSFiles:
    """A self-signed CA and a certificate it signs for ``127.0.0.1`` and ``localhost``
    (RSA 2048, PEM) in `directory`. Skips the test when ``openssl`` is not installed."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", VALID_DAYS, "-subj", "/CN=prefillq test CA",
             cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=localhost", cwd=directory)
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", VALID_DAYS,
             "-extfile", "san.cnf", cwd=directory)
    return TLSFiles(cert=directory / "server.pem", key=directory / "server.key",
                    ca=directory / "ca.pem")
