"""Strict, bounded JSON reading for every config and cache file offload-engine reads.

A config file, a cache entry or a model description is untrusted input
(docs/untrusted-input.md). Python's ``json`` module alone accepts ``NaN`` and ``Infinity``
(and turns ``1e400`` into infinity), reads a file of any size (``/dev/zero`` never ends, a
FIFO blocks forever), recurses into nesting until ``RecursionError`` (and the code that walks
the result recurses again), raises a bare ``ValueError`` for a 4,300-digit integer, lets
a duplicate key silently win, and keeps lone surrogates that fail when printed.
``read_json_file`` and ``parse_json`` refuse each of these with one line naming the file
and what is wrong, as the reader's own error class (an ``InputError`` by default).

The caps are the caller's (each reader states its own, with its reason); the defaults
below bound what any document may do whatever its size.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat

from .errors import InputError

# Nesting of arrays and objects. Real configs nest 2-5 deep (a DeepSpeed config 4, a Hugging
# Face config with text_config.rope_scaling 4, a shape list 3); code that walks a document
# recursively must never reach Python's recursion limit (1000) through it.
MAX_DEPTH = 64
# Digits of one integer literal. A size or count fits in 19 (2**63); 40 leaves room for any
# identifier or seed while refusing the 4,000-digit integers that cost quadratic time to
# convert (and that Python refuses past 4300 digits with a bare ValueError).
MAX_INT_DIGITS = 40

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR,
          "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """"a FIFO", "a character device"... for a ``st_mode`` that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bounded(path: str, max_bytes: int, *, what: str = "file",
                 error: type[Exception] = InputError) -> bytes:
    """The bytes of the regular file ``path``, refused (``error`` naming the file) when it is
    not a regular file (a FIFO, ``/dev/zero``, a directory) or holds more than ``max_bytes``.

    Opened non-blocking, so a FIFO is refused at once instead of waiting for a writer, and
    read with a bounded read, so a file that grows (or lies about its size) costs at most
    ``max_bytes`` + 1 bytes."""
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK
                                                           | os.O_CLOEXEC)) as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise error(f"{path}: is {file_kind(mode)}; a {what} is read only from a "
                            f"regular file")
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: more than {max_bytes} bytes; a {what} of at most {max_bytes} "
                    f"bytes is read")
    return raw


def read_json_file(path: str, max_bytes: int, *, what: str = "JSON file",
                   error: type[Exception] = InputError, max_depth: int = MAX_DEPTH,
                   max_values: int | None = None):
    """``path`` read with ``read_bounded`` and parsed with ``parse_json``."""
    raw = read_bounded(path, max_bytes, what=what, error=error)
    return parse_json(raw, path, error=error, max_depth=max_depth, max_values=max_values)


def parse_json(raw: bytes | str, source: str, *, error: type[Exception] = InputError,
               max_depth: int = MAX_DEPTH, max_values: int | None = None):
    """``raw`` parsed as strict JSON: UTF-8, no NaN or Infinity (nor a literal that overflows
    to it, ``1e400``), integers of at most ``MAX_INT_DIGITS`` digits, no duplicate key in an
    object, no lone surrogate in a string, at most ``max_depth`` nested arrays and objects and
    (when given) about ``max_values`` values, counted by their separators before parsing
    (parsing builds 30 to 100 bytes of Python objects per value). Any other document raises
    ``error`` naming ``source`` and what is wrong, in one line."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{source}: not UTF-8 text (byte {e.start}: {e.reason}); a JSON "
                        f"file is UTF-8") from None
    else:
        text = raw
    if max_values is not None:
        values = text.count(",") + text.count("{") + text.count("[") + 1
        if values > max_values:
            raise error(f"{source}: about {values} JSON values; at most {max_values} are read")
    try:
        doc = json.loads(text, parse_constant=_Bad.constant, parse_int=_int,
                         parse_float=_float, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise error(f"{source}: not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{source}: arrays or objects nested deeper than {max_depth}; refusing "
                    f"it") from None
    _check_tree(doc, source, error, max_depth)
    return doc


class _Bad:
    """What the parser's hooks return for a literal strict JSON refuses; ``_check_tree``
    then refuses it naming its key path (a hook does not know where it is)."""

    def __init__(self, why: str):
        self.why = why

    @classmethod
    def constant(cls, name: str) -> "_Bad":
        return cls(f"{name} is not a JSON number (a finite number is expected)")


def _int(literal: str):
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Bad(f"an integer of {digits} digits; at most {MAX_INT_DIGITS} are read")
    return int(literal)


def _float(literal: str):
    value = float(literal)
    if not math.isfinite(value):
        return _Bad(f"the number {literal[:40]}{'...' if len(literal) > 40 else ''} is too "
                    f"large for a float (it would be infinite)")
    return value


class _Duplicated(dict):
    """An object in which a key appeared twice (``duplicate`` is that key)."""

    duplicate = ""


def _object(pairs: list) -> dict:
    doc = dict(pairs)
    if len(doc) == len(pairs):
        return doc
    seen = set()
    for key, _ in pairs:
        if key in seen:
            out = _Duplicated(doc)
            out.duplicate = key
            return out
        seen.add(key)
    return doc  # not reached


def _show(s: str) -> str:
    """``s`` quoted, escapes spelled out, at most 80 characters: safe to print."""
    text = json.dumps(s[:80])
    return text if len(s) <= 80 else text[:-1] + '..."'


def _path(parts: tuple) -> str:
    """``optimizer.params.lr``, ``points[3].mode``; "the document" for the top."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            shown = p if p.isprintable() and len(p) <= 80 else _show(p)
            out += ("." if out else "") + shown
    return out or "the document"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_tree(doc, source: str, error: type[Exception], max_depth: int) -> None:
    """No container nested deeper than ``max_depth``, no refused literal (``_Bad``), no
    duplicated key, no string or key holding a lone surrogate; an error names the key path.
    Iterative: the document may be as deep as the parser allowed."""
    stack = [((), doc, 1)]
    while stack:
        path, node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise error(f"{source}: arrays or objects nested deeper than {max_depth}; "
                            f"refusing it")
            if isinstance(node, _Duplicated):
                raise error(f"{source}: {_path(path + (node.duplicate,))}: the key appears twice "
                            f"in one object (which one counts would be a guess)")
            for key, value in node.items():
                if _SURROGATE.search(key):
                    raise error(f"{source}: {_path(path)}: the key {_show(key)} is not valid "
                                f"Unicode (a lone surrogate)")
                stack.append((path + (key,), value, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise error(f"{source}: arrays or objects nested deeper than {max_depth}; "
                            f"refusing it")
            stack.extend((path + (i,), value, depth + 1) for i, value in enumerate(node))
        elif isinstance(node, _Bad):
            raise error(f"{source}: {_path(path)}: {node.why}")
        elif isinstance(node, str) and _SURROGATE.search(node):
            raise error(f"{source}: {_path(path)}: the string {_show(node)} is not valid "
                        f"Unicode (a lone surrogate)")
