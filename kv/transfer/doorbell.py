"""The doorbell an engine rings when writes into its pool land, so an event loop waits instead of polling."""

from __future__ import annotations

import socket


class Doorbell:
    """A socket pair that an engine's own threads ring when notices arrive and an event loop waits on."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        try:
            self._write.send(b"\0")
        except (BlockingIOError, InterruptedError):
            return  # bytes are already waiting: the bell is rung

    def clear(self) -> None:
        """Swallow the rings so far (before taking the notices, so a later ring is never lost)."""
        try:
            while self._read.recv(4096):
                continue
        except (BlockingIOError, InterruptedError):
            return

    def close(self) -> None:
        self._read.close()
        self._write.close()
