"""``benchmarks/round_robin.py``: the two-server baseline of ``bench_serving.py --pd`` sends requests to
its servers in turn and relays their answers as they come (here two small HTTP servers of aiohttp)."""

import asyncio
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from round_robin import RoundRobin  # noqa: E402


class Upstream:
    """An HTTP server that answers ``POST /v1/completions`` with its name and the body it got, and
    ``/stream`` with three chunks 0.2 s apart (``left``: the streams whose client left before the end)."""

    def __init__(self, name: str) -> None:
        self.name, self.ready, self.loop, self.left = name, threading.Event(), asyncio.new_event_loop(), 0
        with socket.create_server(("127.0.0.1", 0)) as sock:
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True).start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        async def complete(request: web.Request) -> web.Response:
            return web.json_response({"server": self.name, "got": await request.json(), "query": request.query_string}, status=201)

        async def stream(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            try:
                for i in range(3):
                    await response.write(f"data: {self.name}-{i}\n\n".encode())
                    await asyncio.sleep(0.2)
                await response.write_eof()
            except ConnectionResetError:  # its client left, as a server sees it
                self.left += 1
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/stream", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.ready.set()
        await asyncio.Event().wait()


@pytest.fixture(scope="module")
def upstreams():
    return [Upstream("a"), Upstream("b")]


def test_requests_go_to_the_servers_in_turn_with_their_body_query_and_status(upstreams):
    proxy = RoundRobin([u.url for u in upstreams])
    with proxy as url:
        answers = []
        for i in range(4):
            request = urllib.request.Request(f"{url}/v1/completions?k={i}", json.dumps({"i": i}).encode(), {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                answers.append((response.status, json.loads(response.read())))
    assert [(status, a["server"], a["got"], a["query"]) for status, a in answers] == [
        (201, "a", {"i": 0}, "k=0"), (201, "b", {"i": 1}, "k=1"), (201, "a", {"i": 2}, "k=2"), (201, "b", {"i": 3}, "k=3")]  # fmt: skip
    assert proxy.forwarded == {upstreams[0].url: 2, upstreams[1].url: 2}


def test_a_stream_is_relayed_as_it_comes_not_once_it_ends(upstreams):
    with RoundRobin([upstreams[1].url]) as url, urllib.request.urlopen(f"{url}/stream", timeout=10) as response:
        started, chunks = time.monotonic(), []
        for line in response:
            if line.strip():
                chunks.append((line.decode().strip(), time.monotonic() - started))
    assert [c for c, _ in chunks] == ["data: b-0", "data: b-1", "data: b-2"]
    assert chunks[0][1] < 0.15 and chunks[2][1] > 0.3  # the first before the last was written


def test_a_server_that_cannot_be_reached_is_a_502_naming_it(upstreams):
    with socket.create_server(("127.0.0.1", 0)) as sock:
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with RoundRobin([gone, upstreams[0].url]) as url:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", b"{}", {"content-type": "application/json"}), timeout=10)
        assert refused.value.code == 502 and gone in json.loads(refused.value.read())["error"]["message"]
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", b"{}", {"content-type": "application/json"}), timeout=10) as ok:
            assert json.loads(ok.read())["server"] == "a"


def test_no_upstream_is_refused():
    with pytest.raises(ValueError, match="at least one upstream"):
        RoundRobin([])


def test_a_client_that_leaves_mid_answer_ends_it_quietly_and_the_next_request_is_served(upstreams, caplog):
    """vLLM's benchmark closes a stream at its [DONE], which may come before the server's last bytes: the
    round robin stops relaying and closes the server's answer, with no error logged."""
    left = upstreams[0].left
    with RoundRobin([upstreams[0].url]) as url:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
            client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"data: a-0" not in got:  # the headers, then the first chunk; then gone
                got += client.recv(4096)
        time.sleep(0.6)  # the server's next chunks arrive at the round robin after the client left
        with urllib.request.urlopen(f"{url}/stream", timeout=10) as response:
            assert b"data: a-2" in response.read()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    assert upstreams[0].left == left + 1  # the server saw its client leave
