"""`DelayProxy`: a TCP proxy that delivers every byte `delay_s` late, in each direction, so a
real redis-server behind it answers as one far away would (a round trip costs
``2 * delay_s`` more). Its own asyncio loop runs on a thread; bytes keep their order, and
throughput is not limited by the delay (reading goes on while earlier bytes wait). The
delay can change while connections are open (`delay_s` is read for every chunk)."""

from __future__ import annotations

import asyncio
import threading


class DelayProxy:
    """A proxy on ``127.0.0.1`` (a free port) to `host`:`port`.

    Args:
        host, port: where to forward (a redis-server).
        delay_s: seconds each chunk of bytes waits before it is forwarded, each way (an
            attribute: set it to change the delay of what is read from then on).
    """

    def __init__(self, host: str, port: int, delay_s: float):
        self.target, self.delay_s = (host, port), delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy",
                                        daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connect, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            # closed, not canceled: Python 3.11's stream callback raises on a canceled handler
            self._server.close()
            for writer in self._writers:
                writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait(tasks, timeout=5)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)
        self._writers -= {writer, up_writer}

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if not data:
                    dst.close()
                    return
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await src.read(1 << 16):
                queue.put_nowait((loop.time() + self.delay_s, data))
        except Exception:  # reset, or closed by `stop`: the end of this direction
            pass
        finally:
            queue.put_nowait((loop.time() + self.delay_s, b""))
        try:
            await sender
        except Exception:  # the other side went away first
            dst.close()
