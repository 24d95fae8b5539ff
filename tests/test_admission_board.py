"""The admission board (`cluster/admission_board.py`): what an ingress posts, the proxy reads and answers, and
the ingress counts back; and the proxy middleware and the ingress that use it."""

import asyncio
import json
import multiprocessing as mp
import os
import struct
import subprocess
import sys
import time

from cluster.admission_board import Boards, Posted, key_digest


def test_a_posted_refusal_holds_until_it_lapses_or_the_ingress_opens_the_board(tmp_path):
    board, boards = Posted("engine", directory=tmp_path), Boards(tmp_path)
    assert boards.refusal(None) is None  # posted nothing yet
    now = time.monotonic()
    board.refuse(now + 0.05, 429, 3, "no replica can serve the request within its SLOs now")
    refusal = boards.refusal(None, now=now)
    assert (refusal.status, refusal.retry_after_s, refusal.message) == (429, 3, "no replica can serve the request within its SLOs now")
    assert boards.refusal(None, now=now + 0.06) is None  # lapsed
    board.refuse(now + 0.05, 429, 3, "x")
    board.open()
    assert boards.refusal(None, now=now) is None
    board.close()
    assert not board.path.exists()


def test_the_proxy_refuses_only_while_every_live_board_refuses(tmp_path):
    a, b, boards = Posted("a", directory=tmp_path), Posted("b", directory=tmp_path), Boards(tmp_path)
    now = time.monotonic()
    a.refuse(now + 1.0, 429, 1, "a")
    assert boards.refusal(None, now=now) is None  # b has not refused: another ingress may admit
    b.refuse(now + 1.0, 503, 2, "b")
    assert boards.refusal(None, now=now) is not None
    # A board whose writer is gone is left out, once the proxy looks at its node's boards again.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    b.open()
    raw = bytearray(b.path.read_bytes())
    at = 8 + struct.calcsize("<dhi")  # (the writer pid's field, after the sequence number)
    raw[at:at + 4] = int(gone).to_bytes(4, "little")
    b.path.write_bytes(bytes(raw))
    assert boards.refusal(None, now=now) is None  # (still counted until the rescan)
    assert Boards(tmp_path).refusal(None, now=now) is not None  # a fresh view drops the dead board: a's refusal


def test_a_board_of_an_ingress_with_an_api_key_answers_only_requests_with_that_key(tmp_path):
    board, boards = Posted("engine", api_key="sk-1", directory=tmp_path), Boards(tmp_path)
    board.refuse(time.monotonic() + 1.0, 429, 1, "x")
    assert boards.refusal("Bearer sk-1") is not None
    assert boards.refusal(None) is None and boards.refusal("Bearer sk-2") is None  # forwarded: the ingress answers 401
    assert key_digest("Bearer sk-1") != key_digest("Bearer sk-2")


def test_the_ingress_counts_each_refusal_the_proxy_answered_once(tmp_path):
    board, boards = Posted("engine", directory=tmp_path), Boards(tmp_path)
    board.refuse(time.monotonic() + 1.0, 429, 1, "x")
    for _ in range(3):
        assert boards.refusal(None) is not None
    assert board.counted() == 3 and board.counted() == 0
    board.open()
    assert boards.refusal(None) is None and board.counted() == 0  # forwarded: not counted


def _flip(path: str, stop) -> None:
    """Posts two refusals in turn as fast as it can, from another process, on the board at `path`."""
    import mmap

    board = Posted.__new__(Posted)
    fd = os.open(path, os.O_RDWR)
    board._buf, board.refusing_until, board._key = mmap.mmap(fd, 1024), 0.0, bytes(32)
    while not stop.is_set():
        board.refuse(1e12, 429, 1, "A" * 200)
        board.refuse(1e12, 503, 2, "B" * 7)


def test_a_reader_never_sees_half_of_one_post_and_half_of_another(tmp_path):
    board = Posted("engine", directory=tmp_path)
    board.refuse(1e12, 429, 1, "A" * 200)
    stop = mp.get_context("fork").Event()
    writer = mp.get_context("fork").Process(target=_flip, args=(str(board.path), stop))
    writer.start()
    try:
        boards, seen = Boards(tmp_path), set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            r = boards.refusal(None, now=0.0)
            if r is not None:
                seen.add((r.status, r.retry_after_s, r.message))
    finally:
        stop.set()
        writer.join()
    assert seen <= {(429, 1, "A" * 200), (503, 2, "B" * 7)} and len(seen) == 2, {s[:2] + (s[2][:3], len(s[2])) for s in seen}


def _call(app, path="/v1/completions", headers=()):
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": path, "headers": list(headers)}, None, send))
    return sent


def test_the_proxy_answers_from_the_board_and_forwards_what_it_cannot_answer(tmp_path):
    from cluster.proxy_gate import ANSWERED_HEADER, ProxyGate

    calls = []

    async def ingress(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    board = Posted("engine", directory=tmp_path)
    gate = ProxyGate(ingress, boards=Boards(tmp_path))
    _call(gate)
    assert calls == ["/v1/completions"]  # nothing posted: forwarded
    board.refuse(time.monotonic() + 5.0, 429, 4, "no replica can serve the request within its SLOs now")
    start, body = _call(gate)
    assert calls == ["/v1/completions"] and start["status"] == 429 and gate.answered == 1
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"4" and headers[ANSWERED_HEADER.encode()] == b"proxy"
    assert json.loads(body["body"]) == {"error": {"message": "no replica can serve the request within its SLOs now",
                                                  "type": "RateLimitError", "param": None, "code": 429}}
    _call(gate, headers=[(b"x-slo-tpot-ms", b"10")])  # its own SLO: the ingress decides
    _call(gate, path="/v1/models")  # not an inference route
    assert calls == ["/v1/completions", "/v1/completions", "/v1/models"]
    assert board.counted() == 1
    # Control: without boards (a node with no ingress) everything is forwarded.
    _call(ProxyGate(ingress, boards=Boards(tmp_path / "none")))
    assert len(calls) == 4


def test_the_ingress_posts_its_refusals_counts_the_proxys_and_reopens_when_room_returns(tmp_path, monkeypatch):
    """A full fleet: the ingress refuses before the body and posts it; the proxy's refusals from the board count
    as the ingress's decisions; room on a replica (as a completion would report it) reopens the board. Control:
    with `board: false` nothing is posted."""
    from fastapi.testclient import TestClient
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster.admission_board import BOARD_DIR_ENV
    from cluster.ingress import HandleBackend, IngressConfig
    from cluster.router import AcceptanceHeadroomRouter
    from tests.test_admission import BODY, _body_reading_app, _RecordingHandle
    from tests.test_router import fleet

    monkeypatch.setenv(BOARD_DIR_ENV, str(tmp_path))
    boards = Boards(tmp_path, rescan_s=0.0)

    def served(name: str, board: bool):
        router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name=name, app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(admission={"ttft_ms": 1000.0, "gate_s": 60.0, "board": board})
        backend = HandleBackend(_RecordingHandle(name), IngressConfig(), router.loop)
        return router, backend, _body_reading_app(backend, [])

    routers_loop = asyncio.new_event_loop()

    def replicas(router, loads):
        async def update():  # Serve's router updates its replicas on its event loop
            router.update_replicas(fleet(loads))

        routers_loop.run_until_complete(update())

    def eventually(check, timeout_s: float = 2.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.01)
        return False

    router, backend, app = served("board-on", board=True)
    with TestClient(app) as client:
        replicas(router, [400, 400])
        assert client.post("/v1/completions", json=BODY).status_code == 429  # the ingress's refusal...
        assert boards.refusal(None) is not None  # ... posted, and kept posted while the look refuses
        time.sleep(0.1)
        refused_before = sum(router.loop._refused)
        assert all(boards.refusal(None) is not None for _ in range(5))
        assert eventually(lambda: sum(router.loop._refused) == refused_before + 5)  # counted as the ingress's
        router.loop.gate.open()
        replicas(router, [2, 3])
        router.loop.changed()  # (what a completion calls)
        assert boards.refusal(None) is None
    backend.shutdown()
    assert not list(tmp_path.iterdir())

    monkeypatch.setenv(BOARD_DIR_ENV, str(tmp_path / "missing"))  # nowhere to post: served without a board
    router, backend, _ = served("board-nowhere", board=True)
    assert backend.board is None and router.loop.listeners == []
    monkeypatch.setenv(BOARD_DIR_ENV, str(tmp_path))

    router, backend, app = served("board-off", board=False)
    with TestClient(app) as client:
        replicas(router, [400, 400])
        assert client.post("/v1/completions", json=BODY).status_code == 429
        assert boards.refusal(None) is None and not list(tmp_path.iterdir())
    routers_loop.close()
