"""A panel's background run, shared by the panels (no widget library needed)."""
from __future__ import annotations

import threading


class BackgroundRun:
    """What a panel's Run starts: one run at a time in a daemon thread (`_thread`)."""

    _thread: threading.Thread | None = None

    def run_in_background(self, name: str) -> None:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Join the background run; True when it has finished."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
