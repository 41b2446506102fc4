"""offload_engine/interrupts.py: a real signal that lands inside a section has its handler
called when the section ends (or at a wait inside it), never half way through; handlers
are put back; SIG_DFL / SIG_IGN and other threads are left alone."""

import os
import signal
import sys
import threading

import pytest

from helpers.deadline import within
from offload_engine.interrupts import InterruptSafeCondition, deferred, wait_in_slices
from offload_engine.io.requests import IOFuture


@pytest.fixture
def sigterm_exits():
    """SIGTERM handled the usual way: a handler that calls sys.exit."""
    handler = lambda *_: sys.exit(128 + signal.SIGTERM)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_inside_a_section_comes_out_at_its_end():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred:
            signal.raise_signal(signal.SIGINT)
            reached.append("after the signal")  # the section runs on to its end
            reached.append("end")
    assert reached == ["after the signal", "end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterms_handler_runs_once_the_outermost_section_ends(sigterm_exits):
    reached = []
    with pytest.raises(SystemExit) as info:
        with deferred:
            with deferred:
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("inner end")
            reached.append("outer end")  # not at the inner section's end
    assert info.value.code == 128 + signal.SIGTERM
    assert reached == ["inner end", "outer end"]
    assert signal.getsignal(signal.SIGTERM) is sigterm_exits


def test_every_signal_that_came_gets_its_handler_in_order():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            with deferred:
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGUSR1)
                assert seen == []
        assert seen == [signal.SIGUSR1]  # the handler after the raising one still ran
        assert isinstance(info.value, KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_handlers_are_swapped_only_inside_and_only_python_ones():
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with deferred:
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == previous_term()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def previous_term():
    handler = signal.getsignal(signal.SIGTERM)
    return handler if not callable(handler) else pytest.skip("SIGTERM has a handler here")


def test_a_wait_inside_a_section_answers_ctrl_c_during_it():
    cv = InterruptSafeCondition()
    main = threading.main_thread().ident
    timer = threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    woke = None
    try:
        with pytest.raises(KeyboardInterrupt):
            with cv:
                woke = cv.wait(60)  # without the answer: no notify, False after 60 s
    finally:
        timer.cancel()
    assert woke is None
    assert not cv._is_owned()  # the lock was let go on the way out


def test_a_wait_returns_on_notify_and_a_section_off_the_main_thread_swaps_nothing():
    cv = InterruptSafeCondition()
    seen = {}

    def worker():  # a section on another thread while the main thread is in none
        with cv:
            seen["handler"] = signal.getsignal(signal.SIGINT)
            seen["woke"] = cv.wait(0.01)

    t = threading.Thread(target=worker)
    t.start()
    t.join(30)
    assert seen == {"handler": signal.default_int_handler, "woke": False}

    def notifier():
        with cv:
            cv.notify_all()

    with cv:
        threading.Thread(target=notifier).start()
        assert cv.wait(30)


def signal_as_a_condition_is_entered(monkeypatch):
    """Ctrl-C lands on the main thread just after a ``threading.Condition`` (under Event and
    Future) took its lock, before its ``with`` block began: CPython then leaves the lock
    taken (bpo-29988), and whoever sets the event or the future blocks on it for ever."""
    real, fired = threading.Condition.__enter__, []

    def entering(self):
        got = real(self)
        if threading.current_thread() is threading.main_thread() and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs right here
        return got

    monkeypatch.setattr(threading.Condition, "__enter__", entering)
    return fired


def test_ctrl_c_in_an_io_futures_wait_never_blocks_the_thread_that_completes_it(monkeypatch):
    fut = IOFuture()
    fut.set_running_or_notify_cancel()
    completer = threading.Timer(0.2, lambda: fut.set_result(7))  # the I/O thread's part
    completer.start()
    fired = signal_as_a_condition_is_entered(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fut.result(30)
    assert fired
    monkeypatch.undo()
    completer.join(10)
    assert not completer.is_alive(), "the completing thread is blocked on the future's lock"
    assert within(10, lambda: fut.result(10)) == 7


def test_ctrl_c_in_an_event_wait_never_blocks_the_thread_that_sets_it(monkeypatch):
    event = threading.Event()
    setter = threading.Timer(0.2, event.set)
    setter.start()
    fired = signal_as_a_condition_is_entered(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        wait_in_slices(event.wait, 30)
    assert fired
    monkeypatch.undo()
    setter.join(10)
    assert not setter.is_alive(), "the setting thread is blocked on the event's lock"
    assert wait_in_slices(event.wait, 10)
