"""Admission's answer to any request, posted where the node's HTTP proxy reads it without calling the ingress.

Under overload most requests are refused, and a refusal that crosses the proxy -> ingress hop waits for the
ingress's CPU and event loop: on the 2-core CPU host that hop answered in 10-20 ms at the median and over 50 ms
for 5-15% of refusals at 2-4x the sustainable rate, while the proxy answered its own in 1-2 ms. So the ingress
posts on a board in shared memory (`/dev/shm`, one small file per ingress process) whether admission would
refuse any request with the application's SLOs now (its gate shut, or the router's look before the body,
`AcceptanceHeadroomRouter.refusal_for_any_body`), with the refusal's status, `Retry-After` and message, and
until when that holds. The proxy (`cluster/proxy_gate.py`) refuses a request itself while every live board on
its node refuses, and counts what it refused on the board; the ingress folds those counts into admission's
record of decisions (`AdmissionLoop.decided`), as if it had refused them.

A posted refusal lasts 50 ms (`cluster.ingress.TTL_S`) unless the ingress posts again. It looks again every 20
ms (`REFRESH_S`) while refusing, and at once when a request is placed or completes (the events that most change the
answer), so the proxy's answer is at most a refresh old. Requests the proxy forwards are decided by the ingress
as before. A request carrying its own SLO headers, or the wrong API key, is always forwarded: the ingress
answers those (a tighter SLO or a malformed header, a 401). Where the board's directory cannot be written,
the ingress runs without one (and logs it).

Each field group is written by one process under a sequence number (a seqlock): odd while it is written, and
a reader that sees it change reads again. A board whose writer is gone is ignored.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import struct
import time
from pathlib import Path
from typing import NamedTuple

BOARD_DIR_ENV = "FORESPARK_BOARD_DIR"
PREFIX = "forespark-board-"

# Each group: a sequence number (8 bytes, aligned), then its fields.
# Written by the ingress: refuse until (CLOCK_MONOTONIC s), status, Retry-After s, writer pid, key digest, message.
_POST = struct.Struct("<dhii32s200s")
_POST_AT = 0
# Written by the proxy: refusals it answered.
_COUNT = struct.Struct("<Q")
_COUNT_AT = 512
_SIZE = 1024


def board_dir() -> Path:
    return Path(os.environ.get(BOARD_DIR_ENV, "/dev/shm"))


def node_id() -> str:
    """This process's Ray node (boards of two Ray clusters on one host are apart), or "local" outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except Exception:  # (a Ray without a runtime context here)
        return "local"


def key_digest(authorization: str | None) -> bytes:
    """What the board keeps of an `Authorization` header (the ingress's `Bearer <key>`): its SHA-256."""
    return hashlib.sha256((authorization or "").encode()).digest()


def _seq(buf: mmap.mmap, at: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_buffer(buf, at)  # (one aligned 8-byte load or store; `struct` goes byte by byte)


def _read(buf: mmap.mmap, layout: struct.Struct, at: int) -> tuple | None:
    seq = _seq(buf, at)
    for _ in range(4):
        before = seq.value
        fields = layout.unpack_from(buf, at + 8)
        if before % 2 == 0 and seq.value == before:
            return fields
    return None  # written throughout: taken as no answer


def _write(buf: mmap.mmap, layout: struct.Struct, at: int, *fields) -> None:
    seq = _seq(buf, at)
    seq.value = writing = (seq.value + 1) | 1  # odd while written (even past one left odd by a write cut short)
    layout.pack_into(buf, at + 8, *fields)
    seq.value = writing + 1


class Posted:
    """An ingress's board, as it writes it (`cluster.ingress.HandleBackend.post_board`)."""

    def __init__(self, deployment: str, api_key: str | None = None, directory: Path | None = None, node: str | None = None) -> None:
        self.path = (directory or board_dir()) / f"{PREFIX}{node or node_id()}-{deployment}-{os.getpid()}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._buf = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._key = key_digest(f"Bearer {api_key}") if api_key else bytes(32)
        self.refusing_until = 0.0
        self._counted = 0  # the proxy's refusals already taken (`counted`)

    def refuse(self, until: float, status: int, retry_after_s: int, message: str) -> None:
        self.refusing_until = until
        _write(self._buf, _POST, _POST_AT, until, status, retry_after_s, os.getpid(), self._key, message.encode()[:200])

    def open(self) -> None:
        if self.refusing_until:
            self.refusing_until = 0.0
            _write(self._buf, _POST, _POST_AT, 0.0, 0, 0, os.getpid(), self._key, b"")

    def refusing(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.refusing_until

    def counted(self) -> int:
        """Refusals the proxy answered since the last call."""
        fields = _read(self._buf, _COUNT, _COUNT_AT)
        total = self._counted if fields is None else fields[0]
        new, self._counted = max(total - self._counted, 0), total
        return new

    def close(self) -> None:
        self._buf.close()
        self.path.unlink(missing_ok=True)


class Refusal(NamedTuple):
    status: int
    retry_after_s: int
    message: str


class Boards:
    """The proxy's view of its node's boards (looked up again every `rescan_s`)."""

    def __init__(self, directory: Path | None = None, rescan_s: float = 1.0, node: str | None = None) -> None:
        self.directory = directory or board_dir()
        self.rescan_s = rescan_s
        self.node = node
        self._boards: dict[Path, mmap.mmap] = {}
        self._scanned = -float("inf")

    def _scan(self, now: float) -> None:
        self._scanned = now
        self.node = self.node or node_id()  # (asked here, not at construction: the proxy builds its middleware early)
        found = set(self.directory.glob(f"{PREFIX}{self.node}-*")) if self.directory.is_dir() else set()
        for path in [p for p in self._boards if p not in found]:
            self._boards.pop(path).close()
        for path in found - set(self._boards):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                self._boards[path] = mmap.mmap(fd, _SIZE)
            except (OSError, ValueError):  # (not yet sized by its writer)
                pass
            finally:
                os.close(fd)
        for path, buf in list(self._boards.items()):
            fields = _read(buf, _POST, _POST_AT)
            if fields is not None and fields[3] and not _alive(fields[3]):
                self._boards.pop(path).close()

    def refusal(self, authorization: str | None, now: float | None = None) -> Refusal | None:
        """The refusal every live board posts for a request with this `Authorization` header and no SLO headers
        of its own, or None (forward it)."""
        now = time.monotonic() if now is None else now
        if now - self._scanned > self.rescan_s:
            self._scan(now)
        if not self._boards:
            return None
        refusal = None
        for buf in self._boards.values():
            fields = _read(buf, _POST, _POST_AT)
            if fields is None:
                return None
            until, status, retry_after_s, _, key, message = fields
            if now >= until or (any(key) and key != key_digest(authorization)):
                return None
            refusal = refusal or Refusal(status, retry_after_s, message.rstrip(b"\0").decode(errors="replace"))
        for buf in self._boards.values():
            fields = _read(buf, _COUNT, _COUNT_AT)
            _write(buf, _COUNT, _COUNT_AT, (fields[0] if fields else 0) + 1)
        return refusal


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
