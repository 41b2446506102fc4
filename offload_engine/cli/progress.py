"""Progress bars with rate and ETA for long commands (consolidate, import deepspeed, export,
diff, inspect --stats, bench io, bench disk), drawn by tqdm on stderr, only when stderr is a terminal and never
with --json (a script reading the JSON, or a log file, gets no control characters).

Why tqdm: it is the progress bar Python users already see in pip, Hugging Face and
torch.hub, it is a small pure-Python package, its rate and ETA are smoothed (a slow first
window does not make the ETA jump about), it redraws at a bounded rate and degrades to one
line on narrow terminals. rich draws finer bars but brings its console machinery (markup,
themes, a larger import) for a single line. tqdm is imported when a bar is drawn, never at
start-up.
"""

from __future__ import annotations

import sys


def wanted(args=None, stream=None) -> bool:
    """True when a progress bar should be drawn: ``stream`` (stderr) is a terminal and the
    command was not asked for --json."""
    stream = sys.stderr if stream is None else stream
    if args is not None and getattr(args, "json", False):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressLine:
    """A byte progress bar, called as ``progress(done, total)`` (bytes): percent, bytes
    done of total, rate and ETA; the line is finished when done reaches total."""

    def __init__(self, stream=None, label: str = "consolidate"):
        self.stream = sys.stderr if stream is None else stream
        self.label = label
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.label, unit="B", unit_scale=True,
                            unit_divisor=1000, file=self.stream, mininterval=0.2,
                            dynamic_ncols=True, leave=True)
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def write(self, line: str) -> None:
        """Print ``line`` on the bar's stream, above the bar (which is drawn again below)."""
        if self.bar is None:
            print(line, file=self.stream, flush=True)
        else:
            self.bar.write(line, file=self.stream)

    def close(self) -> None:
        """Finish the line (also on an error part way: the next message starts on its own)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ByteCounter:
    """Adds up the bytes a measurement moves, called as ``counter(nbytes)`` after each
    piece, into ``progress(done, total)`` (a ``ProgressLine``; None: counts only)."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)


class RankProgress:
    """Progress over the ranks a checkpoint is written for, called as
    ``progress(rank, bytes written so far)`` after each rank: ranks done of total with an
    ETA, and the bytes written with their rate."""

    def __init__(self, ranks: int, stream=None, label: str = "import"):
        from tqdm import tqdm

        self.bar = tqdm(total=ranks, desc=label, unit="rank", file=sys.stderr
                        if stream is None else stream, mininterval=0.2, dynamic_ncols=True)

    def __call__(self, rank: int, written: int) -> None:
        from tqdm import tqdm

        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_postfix_str(f"{tqdm.format_sizeof(written, 'B', 1000)} written, "
                                 f"{tqdm.format_sizeof(written / elapsed, 'B/s', 1000)}",
                                 refresh=False)
        self.bar.update(rank + 1 - self.bar.n)

    def close(self) -> None:
        self.bar.close()
