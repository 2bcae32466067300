"""ServiceThread: the one base of every background service (flush, dispatch, clean, checkpoint)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class ServiceThread:
    """A daemon thread running ``run_once`` every ``interval`` seconds until shut down.

    ``wakeup()`` cuts the current wait short.  ``on_shutdown`` runs once in the
    service's thread after the loop ends (a flusher's final flush).
    """

    name = "ServiceThread"

    def __init__(self, interval: float, initial_delay: float = 0.0) -> None:
        self.interval = interval
        self.initial_delay = initial_delay
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def wakeup(self) -> None:
        self._wake.set()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wait_for_running(self, timeout: float) -> None:
        if self._wake.wait(timeout):
            self._wake.clear()

    def _loop(self) -> None:
        if self.initial_delay:
            self._stopped.wait(self.initial_delay)
        while not self._stopped.is_set():
            failed = False
            try:
                self.run_once()
            except Exception:  # a service must survive one bad round; the log says why
                log.exception("%s failed a round", self.name)
                failed = True
            if self._stopped.is_set():
                break
            # After a failure (a full disk, say) retry no faster than once a second.
            self.wait_for_running(max(self.interval, 1.0) if failed else self.interval)
        try:
            self.on_shutdown()
        except Exception:
            log.exception("%s failed at shutdown", self.name)

    def run_once(self) -> None:
        raise NotImplementedError

    def on_shutdown(self) -> None:
        """Last work after the loop stops (default: nothing)."""

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
