"""Owned threads: whoever starts a thread joins it, and a thread that does not end is named."""

from __future__ import annotations

import threading


class ThreadLeft(TimeoutError):
    """A thread did not end within its owner's stop deadline."""


def join(thread: threading.Thread | None, timeout: float) -> None:
    """Joins `thread` (None: nothing to join); raises ThreadLeft naming it if it has not ended
    within `timeout` seconds."""
    if thread is None or thread is threading.current_thread():
        return
    thread.join(timeout)
    if thread.is_alive():
        raise ThreadLeft(f"thread {thread.name!r} did not end within {timeout} s of its stop")
