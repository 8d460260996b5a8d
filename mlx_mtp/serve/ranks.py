"""Starting a server over several processes: every rank checks that it runs
rank 0's command (``handshake``), and keeps a TCP line to rank 0 beside
MLX's own connections (``Liveness``).

MLX's ring backend (0.32) fails the first collective with a dead peer after
about a second of retries, handing back uninitialised memory, and may wait
for ever in the next one. A process that dies has its connections closed by
the kernel at once, so the line tells the other side within milliseconds,
even while its engine waits in a collective that will never end. The line
also wakes idle ranks: they wait on it rather than in a collective, where
the ring backend polls.
"""

import hashlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..defaults import VERSION as __version__
from ..distributed import PeerLost, gather
from ..errors import MTPError

HANDSHAKE_BYTES = 2048
LOST_GRACE = 1.0  # seconds rank 0 keeps answering 503 before it exits
CONNECT_TIMEOUT = 30.0


def fingerprint(model, settings: Dict[str, object]) -> Dict[str, str]:
    """What must be the same on every rank, each as a short hash: the model
    folder (its path and its config.json), and ``settings`` (option -> value)."""
    folder = Path(str(model)).expanduser() if model is not None else None
    config = b""
    if folder is not None and (folder / "config.json").is_file():
        config = (folder / "config.json").read_bytes()
    values = {
        "model folder": str(folder),
        "model config.json": config,
        "mlx-mtp and MLX versions": f"{__version__} {mx.__version__}",
        **settings,
    }

    def digest(value) -> str:
        raw = value if isinstance(value, bytes) else repr(value).encode()
        return hashlib.sha256(raw).hexdigest()[:12]

    return {name: digest(value) for name, value in values.items()}


def _rows(group, record: dict) -> List[dict]:
    data = json.dumps(record).encode()
    if len(data) > HANDSHAKE_BYTES:
        raise MTPError("the start message is too long")
    row = np.zeros(HANDSHAKE_BYTES, np.uint8)
    row[: len(data)] = np.frombuffer(data, np.uint8)
    try:
        rows = gather(row, group)
    except PeerLost as e:
        raise MTPError(f"a process stopped before all had started: {e}") from None
    return [json.loads(bytes(r).rstrip(b"\0")) for r in rows]


def handshake(group, mine: Dict[str, str]) -> "Liveness":
    """Every rank checks its fingerprint against rank 0's (one line naming what
    differs, on every rank, where one does not match), then each connects to
    rank 0 (``Liveness``)."""
    liveness = Liveness(group)
    record = {"fingerprint": mine, **liveness.address()}
    rows = _rows(group, record)
    first = rows[0]["fingerprint"]
    for rank, row in enumerate(rows[1:], 1):
        other = row["fingerprint"]
        names = [
            k for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k)
        ]
        if names:
            liveness.close()
            raise MTPError(
                f"rank {rank} was started with another {', '.join(names)} than "
                "rank 0: start every rank with the same serve command and model"
            )
    error = liveness.connect(rows[0])
    failed = [(r, row["error"]) for r, row in enumerate(_rows(group, {"error": error}))]
    failed = [(r, e) for r, e in failed if e]
    if failed:
        liveness.close()
        rank, error = failed[0]
        raise MTPError(f"rank {rank}: cannot reach rank 0 ({error})")
    liveness.watch()
    return liveness


def _leader_host() -> str:
    """Rank 0's address as ``mlx.launch`` gave it: the ring hostfile's first
    entry, or the jaccl coordinator."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    try:
        if hostfile:
            hosts = json.loads(Path(hostfile).read_text())
            return str(hosts[0][0]).rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        pass
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return ""  # unknown: every interface on rank 0, this machine on the others


class Liveness:
    """A TCP connection from every other rank to rank 0, outside MLX. A
    process that dies has its connections closed by the kernel at once, so
    the other side learns it within milliseconds (``on_lost(rank)``), even
    while its engine waits in a collective that will never end."""

    def __init__(self, group):
        self.rank, self.size = group.rank(), group.size()
        self.token = secrets.token_hex(16)
        self.sockets: Dict[int, socket.socket] = {}
        self.server: Optional[socket.socket] = None
        self.closing = False
        self.wakes = threading.Semaphore(0)  # rank 0's wake-ups, on the others
        self.on_lost: Callable[[int], None] = _exit_lost
        if self.rank == 0:  # on the address the others reach, where it can
            try:
                self.server = socket.create_server((_leader_host(), 0))
            except OSError:
                self.server = socket.create_server(("", 0))

    def address(self) -> dict:
        if self.server is None:
            return {}
        return {"port": self.server.getsockname()[1], "token": self.token}

    def connect(self, leader: dict) -> str:
        """Connect (other ranks) or accept every rank's connection (rank 0);
        the error, or ""."""
        try:
            if self.rank != 0:
                s = socket.create_connection(
                    (_leader_host() or "127.0.0.1", leader["port"]),
                    timeout=CONNECT_TIMEOUT,
                )
                s.sendall(f"{leader['token']} {self.rank}\n".encode())
                s.settimeout(None)
                self.sockets[0] = s
                return ""
            self.server.settimeout(CONNECT_TIMEOUT)
            while len(self.sockets) < self.size - 1:
                s, _ = self.server.accept()
                s.settimeout(CONNECT_TIMEOUT)
                token, _, rank = s.recv(256).decode(errors="replace").partition(" ")
                if token != self.token or not rank.strip().isdigit():
                    s.close()  # not one of ours
                    continue
                s.settimeout(None)
                self.sockets[int(rank)] = s
            return ""
        except OSError as e:
            return str(e) or type(e).__name__

    def watch(self) -> None:
        for rank, s in self.sockets.items():
            t = threading.Thread(target=self._wait, args=(rank, s), daemon=True)
            t.start()

    def wake(self) -> None:
        """Rank 0: the others may enter the next collective."""
        for s in self.sockets.values():
            try:
                s.sendall(b"w")
            except OSError:
                pass  # its watcher says so

    def wait_wake(self) -> None:
        self.wakes.acquire()

    def _wait(self, rank: int, s: socket.socket) -> None:
        try:
            while True:
                data = s.recv(64)
                if not data:
                    break
                for _ in data:
                    self.wakes.release()
        except OSError:
            pass
        if not self.closing:
            self.on_lost(rank)

    def close(self) -> None:
        self.closing = True
        for s in list(self.sockets.values()) + [self.server]:
            if s is not None:
                s.close()


def _exit_lost(rank: int) -> None:
    """Before the engine runs: a rank that stops ends this one."""
    print(f"error: rank {rank} of this server stopped", file=sys.stderr, flush=True)
    os._exit(1)


def exit_soon(message: str, code: int = 1, after: float = LOST_GRACE) -> None:
    """Say ``message`` and end the process ``after`` seconds from now: rank 0
    answers 503 meanwhile; its engine may be waiting in a collective with the
    lost rank that never ends, so the process cannot wait for it."""
    print(f"error: {message}", file=sys.stderr, flush=True)

    def end() -> None:
        time.sleep(after)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=end, daemon=True).start()
