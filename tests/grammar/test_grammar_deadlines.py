"""grammar.deadlines: the compile cache's timeouts on one thread."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from radixlm.grammar.deadlines import Deadlines


def test_callbacks_run_in_deadline_order_on_one_thread() -> None:
    # the clock stands still while the deadlines are set, so a slow (loaded) machine scheduling
    # them cannot reorder them: every deadline is exactly start + delay
    start: list[float | None] = [time.monotonic()]
    deadlines = Deadlines(
        name="test-deadlines", clock=lambda: start[0] if start[0] is not None else time.monotonic()
    )
    ran: list[tuple[int, str]] = []
    done = threading.Event()
    before = threading.active_count()
    for i, delay in enumerate([0.30, 0.10, 0.20] * 100):
        deadlines.call_after(delay, lambda i=i: ran.append((i, threading.current_thread().name)))
    deadlines.call_after(0.4, done.set)
    start[0] = None
    assert threading.active_count() <= before + 1  # 301 deadlines, one thread
    assert done.wait(5)
    assert len(ran) == 300 and {name for _, name in ran} == {"test-deadlines"}
    order = [i % 3 for i, _ in ran]
    assert order == [1] * 100 + [2] * 100 + [0] * 100
    assert len(deadlines) == 0


def test_cancelled_callbacks_never_run_and_are_freed_at_once() -> None:
    deadlines = Deadlines()

    class Payload:
        ran = False

        def __call__(self) -> None:
            self.ran = True

    payload = Payload()
    ref = weakref.ref(payload)
    handle = deadlines.call_after(0.05, payload)
    deadlines.cancel(handle)
    del payload
    gc.collect()
    assert ref() is None  # not held until its deadline
    deadlines.cancel(handle)  # twice, or after running: a no-op
    time.sleep(0.1)
    assert len(deadlines) == 0


def test_a_failing_callback_does_not_stop_the_others(caplog) -> None:
    deadlines = Deadlines()
    done = threading.Event()
    deadlines.call_after(0.01, lambda: 1 / 0)
    deadlines.call_after(0.02, done.set)
    assert done.wait(5)
    assert "deadline callback failed" in caplog.text
    # a deadline earlier than the one being waited for is still met
    early = threading.Event()
    deadlines.call_after(5.0, lambda: None)
    time.sleep(0.05)
    deadlines.call_after(0.01, early.set)
    assert early.wait(1)


def test_close_ends_the_thread_and_drops_what_was_pending() -> None:
    deadlines = Deadlines(name="closing-deadlines")
    ran = threading.Event()
    deadlines.call_after(0.2, ran.set)
    (thread,) = [t for t in threading.enumerate() if t.name == "closing-deadlines"]
    deadlines.close()
    thread.join(2)
    assert not thread.is_alive() and len(deadlines) == 0
    deadlines.call_after(0.0, ran.set)  # after close: ignored
    assert not ran.wait(0.3)
