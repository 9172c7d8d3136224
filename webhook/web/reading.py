"""Clients that do not read their answers: the stall cut of one connection and the process's unread budget.

- Stall cut: a connection whose writes are paused (its client reads slower than it asks) is not read from,
  and must read MIN_READ_PROGRESS of its answers every STALL_SECONDS, or it is cut off.
- Unread budget: answers written and not yet read, all connections of the process together (the transports'
  buffers and the sockets' send queues), stay within UNREAD_BUDGET. Past it, the connections whose clients
  went longest without reading are cut off, down to UNREAD_AFTER_CUT.

A client's reading is measured on its socket: the transport's buffer, the send queue (SIOCOUTQ) and the
bytes it acknowledged (TCP_INFO's tcpi_bytes_acked). Once a receive buffer is full, a client acknowledges
only what it reads. Each policy keeps its own record per connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import time
from typing import Any, Protocol

MIN_READ_PROGRESS = 16 * 1024
STALL_SECONDS = 5.0
UNREAD_BUDGET = 16 * 1024 * 1024
UNREAD_AFTER_CUT = 12 * 1024 * 1024
MEASURE_STEP = 1024 * 1024  # after a measure within the budget, how much more is counted before the next
# struct tcp_info (linux/tcp.h): the u64 tcpi_bytes_acked at offset 120, since Linux 4.1.
_BYTES_ACKED = struct.Struct("=120xQ")
_TCP_INFO_SIZE = 256


class Reader(Protocol):
    """A connection whose client reads (or does not read) its answers."""

    transport: Any
    client: str

    def cut_off(self, kind: str, message: str, *args: object) -> None: ...


def bytes_acked(transport: Any) -> int:
    """Bytes of answers the client's end has acknowledged; 0 where the socket cannot say."""
    sock = transport.get_extra_info("socket")
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except (OSError, AttributeError, ValueError):
        return 0
    return int(_BYTES_ACKED.unpack_from(info)[0]) if len(info) >= _BYTES_ACKED.size else 0


def held_and_acked(transport: Any) -> tuple[int, int]:
    """Bytes of answers waiting in the transport and the socket's send queue, and the bytes acknowledged."""
    held = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError, ValueError):
        held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return held, bytes_acked(transport)


class Stalls:
    """The stall cut: connections paused on their client, and what each had acknowledged when last checked."""

    def __init__(self) -> None:
        self._acked: dict[Reader, int] = {}

    def paused(self, conn: Reader) -> None:
        self._acked[conn] = bytes_acked(conn.transport)

    def resumed(self, conn: Reader) -> None:
        self._acked.pop(conn, None)

    def check(self, conn: Reader) -> bool:
        """STALL_SECONDS after a pause or the last check: True (check again later) while the client read
        MIN_READ_PROGRESS since; else it is cut off."""
        acked = bytes_acked(conn.transport)
        if acked - self._acked.get(conn, acked) >= MIN_READ_PROGRESS:
            self._acked[conn] = acked
            return True
        self._acked.pop(conn, None)
        conn.cut_off("stalled", "connection from %s cut off: its answers were not read", conn.client)
        return False


class _Owed:
    """One connection's record in the budget."""

    __slots__ = ("read_at", "seen", "unread")

    def __init__(self) -> None:
        self.unread = 0  # bytes written since the client was last measured to have read them all
        self.read_at = time.monotonic()  # when the client was last seen reading
        self.seen: tuple[int, int] | None = None  # (acknowledged, held) when last seen reading


class Unread:
    """Bytes of answers the clients may not have read yet, counted as they are written and measured
    connection by connection only once the count passes the budget.

    A client is seen reading when it holds less than MIN_READ_PROGRESS, or has acknowledged
    MIN_READ_PROGRESS more (or all it held) since it was last seen reading: the API server reads each answer
    at once, yet the last one stays in the send queue until its next request carries the acknowledgement.
    After a measure within the budget the next waits for MEASURE_STEP more bytes, so clients holding just
    under the budget do not make every write measure every connection."""

    def __init__(self, budget: int = UNREAD_BUDGET, after_cut: int = UNREAD_AFTER_CUT) -> None:
        self.budget, self.after_cut = budget, after_cut
        self.total = 0
        self.cut = 0
        self._next = budget  # the count past which to measure
        self._owing: dict[Reader, _Owed] = {}  # connections counted since they last measured 0

    def wrote(self, conn: Reader, size: int) -> None:
        if not size:
            return
        owed = self._owing.get(conn)
        if owed is None:
            owed = self._owing[conn] = _Owed()  # it had read all there was
        owed.unread += size
        self.total += size
        if self.total > self._next:
            self._measure()

    def unread(self, conn: Reader) -> int:
        owed = self._owing.get(conn)
        return owed.unread if owed is not None else 0

    def forget(self, conn: Reader) -> None:
        owed = self._owing.pop(conn, None)
        if owed is not None:
            self.total -= owed.unread

    def _measure(self) -> None:
        now, total = time.monotonic(), 0
        for conn, owed in list(self._owing.items()):
            held, acked = held_and_acked(conn.transport)
            seen = owed.seen
            if held < MIN_READ_PROGRESS or (seen is not None and acked - seen[0] >= min(MIN_READ_PROGRESS, seen[1])):
                owed.seen, owed.read_at = (acked, held), now
            elif seen is None:
                owed.seen = (acked, held)
            owed.unread = held
            total += held
            if not held:
                del self._owing[conn]
        self.total = total
        if total > self.budget:
            self._cut(now, total)
        self._next = max(self.budget, self.total + MEASURE_STEP)

    def _cut(self, now: float, total: int) -> None:
        for conn, owed in sorted(self._owing.items(), key=lambda item: (item[1].read_at, -item[1].unread)):
            if self.total <= self.after_cut:
                break
            self.cut += 1
            self.forget(conn)
            conn.cut_off(
                "unread",
                "connection from %s cut off: %d bytes of answers unread since %.1f s, with %d MB unread in all "
                "(over %d MB); %d cut so far",
                conn.client,
                owed.unread,
                now - owed.read_at,
                total >> 20,
                self.budget >> 20,
                self.cut,
            )
