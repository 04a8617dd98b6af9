"""Requests spread over several OpenAI servers in turn, behind one address: the two-server baseline of
``bench_serving.py --pd`` (vLLM alone as one server per GPU, as the disaggregation issue allows beside
``--data-parallel-size 2``), since vLLM's benchmark sends to one URL and the offline bundles carry no
router (vLLM's is a separate Rust project).

    with RoundRobin(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as url:
        ...  # each request to url goes to the next server, its answer streamed back as it comes

Each request is forwarded whole (method, path, query, body, and its headers but the hop-by-hop ones:
``Host``, ``Content-Length``, ...) to the next server, and its answer is relayed chunk by chunk (a
stream's events as they come), status and headers with it. A server that cannot be reached answers
502 naming it; one lost mid-answer ends the answer short; a client that leaves mid-answer has the
server's answer closed, as if it had left the server. ``forwarded`` counts the requests each took.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}  # set again by each hop


class RoundRobin:
    def __init__(self, upstreams: list[str], host: str = "127.0.0.1") -> None:
        if not upstreams:
            raise ValueError("RoundRobin needs at least one upstream server")
        self.upstreams, self.host = list(upstreams), host
        self.forwarded = dict.fromkeys(self.upstreams, 0)
        self._next = itertools.cycle(self.upstreams)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="round-robin", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the round-robin proxy did not start within 30 s")
        return self.url

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        with socket.create_server((self.host, 0)) as sock:
            port = sock.getsockname()[1]
        site = web.TCPSite(runner, self.host, port)
        await site.start()
        self.url = f"http://{self.host}:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as self._session:
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        upstream = next(self._next)
        self.forwarded[upstream] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        try:
            answer = await self._session.request(request.method, upstream + request.rel_url.path_qs, data=await request.read(), headers=headers)
        except aiohttp.ClientConnectionError as exc:
            return web.json_response({"error": {"message": f"round robin: {upstream} cannot be reached ({exc})", "code": 502}}, status=502)
        async with answer:  # a server lost mid-answer ends the client's answer short, as the server alone would
            response = web.StreamResponse(status=answer.status, headers={k: v for k, v in answer.headers.items() if k.lower() not in HOP})
            await response.prepare(request)
            try:
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:  # the client left (vLLM's benchmark closes at [DONE]): the server's answer is closed, as it would be
                pass
        return response
