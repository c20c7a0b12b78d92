"""Servers the tests start as real processes on loopback: a command whose output announces its URL
once it listens (``agentspec serve`` and the replay server: ``... ready at http://127.0.0.1:PORT/v1``)."""

from __future__ import annotations

import re
import subprocess
import threading

import pytest

READY = re.compile(r"ready at (http://127\.0\.0\.1:\d+/v1)")


class ServerProcess:
    """A server command and its output, read on a thread for the ready line."""

    def __init__(
        self, command: list[str], *, env: dict[str, str] | None = None, start_timeout_s: float = 600, ready: re.Pattern[str] = READY
    ) -> None:
        """``ready`` finds the line that says the server listens; its group 1 is the base URL."""
        self.command = command
        self.ready = ready
        self.start_timeout_s = start_timeout_s
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = self.ready.search(line)
            if found and self.url is None:
                self.url = found.group(1)
                self._ready.set()
        self._ready.set()  # the process ended

    def wait_ready(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT/v1``); fails the test if it did not start."""
        self._ready.wait(self.start_timeout_s)
        if self.url is None:
            pytest.fail(f"{' '.join(self.command)} did not start (exit code {self.proc.poll()}):\n{''.join(self.lines)}")
        return self.url

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def agentspec_serve(*flags: str, start_timeout_s: float = 600) -> ServerProcess:
    """``agentspec serve --port 0 FLAGS`` (a free loopback port), without the caller's
    ``$AGENTSPEC_API_KEY``; ``wait_ready`` gives its URL, ``stop`` ends it."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AGENTSPEC_API_KEY"}
    return ServerProcess([sys.executable, "-m", "agentspec", "serve", "--port", "0", *flags], env=env, start_timeout_s=start_timeout_s)
