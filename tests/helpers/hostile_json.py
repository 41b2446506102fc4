"""Hostile JSON documents for the config readers: structured cases (every leaf of a real
document replaced by each hostile value, whole-document attacks) and random byte-level
mutations from a fixed seed. Used by tests/formats/test_fuzz_config_inputs.py to drive
``config from-deepspeed``, ``plan --model`` and the device-profile cache.

Values are raw JSON text spliced in where a leaf was, so documents Python's ``json`` would
never write (``NaN``, a 4,000-digit integer, 100,000 nested arrays) reach the reader.
"""

from __future__ import annotations

import json
import random

# (label, raw JSON text of the value)
HOSTILE_VALUES = [
    ("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"),
    ("overflowing float", "1e400"), ("null", "null"), ("empty list", "[]"),
    ("empty object", "{}"), ("list of one", "[1]"), ("object", '{"a": 1}'),
    ("string", '"abc"'), ("empty string", '""'), ("true", "true"), ("false", "false"),
    ("-1", "-1"), ("0", "0"), ("non-integral", "4096.5"), ("negative float", "-0.5"),
    ("tiny float", "5e-324"), ("2**63", str(2**63)), ("10**30", str(10**30)),
    ("4000-digit integer", "9" * 4000), ("4000-digit float", "1" + "0" * 4000 + ".5"),
    ("deep list", "[" * 100_000 + "]" * 100_000), ("deep object", '{"a":' * 3000 + "1" + "}" * 3000),
    ("terminal escape", '"\\u001b[2J\\u001b[31mred"'), ("lone surrogate", '"\\ud800"'),
    ("NUL in string", '"a\\u0000b"'), ("integral float", "1e9"),
    ("long string", '"' + "a" * 100_000 + '"'), ("auto", '"auto"'),
]

_MARK = "\x00HOSTILE\x00"


def leaf_paths(doc, prefix=()) -> list[tuple]:
    """Paths (tuples of keys and indices) of every leaf and every container in ``doc``."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(prefix + (k,))
            out.extend(leaf_paths(v, prefix + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append(prefix + (i,))
            out.extend(leaf_paths(v, prefix + (i,)))
    return out


def splice(doc, path: tuple, raw_value: str) -> bytes:
    """``doc`` as JSON bytes with the value at ``path`` replaced by the raw text ``raw_value``."""
    copy = json.loads(json.dumps(doc))
    node = copy
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = _MARK
    return json.dumps(copy).replace(json.dumps(_MARK), raw_value).encode("utf-8", "surrogatepass")


def structured_cases(doc) -> list[tuple[str, bytes]]:
    """Every leaf and container of ``doc`` replaced by every hostile value, then attacks on
    the whole document. Names say which, for a failing case's report."""
    cases = []
    for path in leaf_paths(doc):
        for label, raw in HOSTILE_VALUES:
            cases.append((f"{'.'.join(map(str, path))} = {label}", splice(doc, path, raw)))
    cases.extend(document_cases(doc))
    return cases


def document_cases(doc) -> list[tuple[str, bytes]]:
    """Attacks on a whole document (``doc`` is a real one to start from)."""
    text = json.dumps(doc)
    first_key = next(iter(doc)) if isinstance(doc, dict) and doc else "a"
    return [
        ("empty file", b""), ("whitespace", b" \n\t "), ("a list", b"[1, 2]"), ("a number", b"42"),
        ("a string", b'"x"'), ("null", b"null"), ("binary", bytes(range(256)) * 4),
        ("UTF-8 BOM", b"\xef\xbb\xbf" + text.encode()), ("UTF-16", text.encode("utf-16")),
        ("truncated", text.encode()[: len(text) // 2]),
        ("trailing garbage", text.encode() + b" }"),
        ("duplicate key", ("{" + json.dumps(first_key) + ": 1, " + text[1:]).encode()),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
        ("deep nesting of objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("NaN document", b"NaN"), ("4000-digit document", b"9" * 4000),
        ("2 MiB of spaces then the document", b" " * (2 << 20) + text.encode()),
        ("control character key", ("{" + json.dumps("\x1b[2Jk") + ": 1, " + text[1:]).encode()),
        ("lone surrogate key", ('{"\\udc80": 1, ' + text[1:]).encode()),
        ("invalid UTF-8", text.encode()[:-1] + b"\xff}"),
    ]


def mutations(doc, count: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` random mutations of ``doc``'s JSON bytes (byte flips, insertions of JSON
    punctuation or hostile tokens, deletions, duplications), deterministic for ``seed``."""
    rng = random.Random(seed)
    base = json.dumps(doc, indent=1).encode()
    tokens = [b"NaN", b"Infinity", b"-1", b"1e400", b"null", b"[", b"]", b"{", b"}", b",",
              b":", b'"', b"\\", b"9" * 50, b"\xff", b"\x00", b"true", b"0", b"-0.5"]
    out = []
    for i in range(count):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data) + 1)
            op = rng.randrange(4)
            if op == 0 and data:
                data[min(pos, len(data) - 1)] = rng.randrange(256)
            elif op == 1:
                data[pos:pos] = rng.choice(tokens)
            elif op == 2:
                del data[pos:pos + rng.randint(1, 16)]
            else:
                start = rng.randrange(len(data) or 1)
                data[pos:pos] = data[start:start + rng.randint(1, 64)]
        out.append((f"mutation {i} (seed {seed})", bytes(data)))
    return out


def sample(cases: list, count: int, seed: int) -> list:
    """At most ``count`` of ``cases``, chosen from ``seed`` (the same ones every run), in order."""
    if len(cases) <= count:
        return cases
    keep = sorted(random.Random(seed).sample(range(len(cases)), count))
    return [cases[i] for i in keep]
