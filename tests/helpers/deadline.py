"""Run a call that might hang with a deadline, so a hang fails the test instead of the run."""

import threading


def within(seconds, fn):
    """fn() on a thread; fails the test if it has not returned after ``seconds``, else
    returns its result (or raises its error)."""
    out, errors, done = [], [], threading.Event()

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (a hang)"
    if errors:
        raise errors[0]
    return out[0]
