"""The docs' example sessions (`tests.docs.examples.SESSIONS`), started together so their
model loads overlap: each test module that runs one names it in ``SESSION``."""

from __future__ import annotations

import pytest

from tests.docs.examples import Script, session_blocks
from worker.redis_server import RedisServer, free_port


@pytest.fixture(scope="session")
def example_scripts(request, tmp_path_factory):
    """{session name: its running `Script`} for the sessions the selected tests name. A
    session whose blocks start their own redis-server (operations.md's) gets a free port for
    it; the others use one real redis-server of the fixture's."""
    names = {getattr(item.module, "SESSION", None) for item in request.session.items} - {None}
    with RedisServer() as server:
        scripts = {}
        for name in sorted(names):
            blocks = session_blocks(name)
            starts_redis = any("redis-server &" in b.text for b in blocks)
            scripts[name] = Script(blocks, free_port() if starts_redis else server.port,
                                   free_port(), tmp_path_factory.mktemp(name))
        try:
            yield scripts
        finally:
            for script in scripts.values():
                script.kill()
