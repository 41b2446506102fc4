"""An unpickler whose memory use is bounded by a budget, whatever the pickle says.

``pickle``'s C unpickler allocates from fields it reads before it checks them against the
data: a 5-byte LONG_BINPUT makes it grow its memo to 2**31 slots, a BYTEARRAY8 length
makes it allocate that many bytes before reading any, and cheap opcodes (one byte of
EMPTY_SET builds a 216-byte set; three bytes re-used from the memo can copy a million-item
list into a new set) multiply a small file into gigabytes. ``BoundedUnpickler`` is the pure
Python unpickler with every opcode priced: each one charges an upper bound of the bytes it
builds to a budget before or as it runs, and a pickle that would exceed the budget stops
with ``pickle.UnpicklingError``. Because the memo grows by one entry per memo opcode (a
list for the indices that come in order, as torch.save writes them, and a dict for any
other: ``_Memo``) and every read goes through ``io.BytesIO`` (which returns at most what it
holds), no length field can allocate more than the pickle's own size.

BUILD (``__setstate__``) is refused on every object except the types a subclass lists in
``BUILD_TYPES``: BUILD writes into an object's ``__dict__`` even when the object is frozen
or shared (a dtype constant), which would change a tensor's checked shape after the check.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys

# Bytes charged per opcode not listed below: a stack slot and a small object (an empty
# list is 56 bytes, a float 24, an int 28).
OPCODE_BYTES = 64

# Opcodes that push an object that already exists (None, a bool, a small int, a memo entry)
# or only move references: a stack slot and a little slack.
_REFERENCE_BYTES = 16
_REFERENCE_OPS = frozenset(op[0] for op in (
    pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.BINGET, pickle.GET,
    pickle.LONG_BINGET, pickle.DUP, pickle.EMPTY_TUPLE, pickle.BININT1, pickle.POP,
    pickle.POP_MARK, pickle.STOP, pickle.PROTO, pickle.FRAME))

# Opcodes that build bigger objects than OPCODE_BYTES covers, charged before they run.
_FIXED = {
    pickle.EMPTY_SET[0]: 224,       # sys.getsizeof(set()) and a stack slot
    pickle.BINPERSID[0]: 160,       # a storage record's description
    pickle.PERSID[0]: 160,
    pickle.REDUCE[0]: 512,          # a stand-in object: instance, its __dict__, 3 fields
    pickle.NEWOBJ[0]: 512,
    pickle.NEWOBJ_EX[0]: 512,
    pickle.OBJ[0]: 512,
    pickle.INST[0]: 512,
}

# Opcodes that move the items above the last MARK (or the top one or two) into a
# container: bytes per item of the container's growth (a list slot with over-allocation,
# a dict entry with its hash table share, a set entry likewise).
_GROW = {
    pickle.APPENDS[0]: 16, pickle.APPEND[0]: 16,
    pickle.SETITEMS[0]: 56, pickle.SETITEM[0]: 112,   # per stack item: half a pair
    pickle.ADDITEMS[0]: 64,
}
_GROW_ALL = frozenset(op[0] for op in (pickle.APPENDS, pickle.SETITEMS, pickle.ADDITEMS))

# Opcodes that push a new object whose size follows from the data read (str, bytes, int)
# or from the stack (a tuple, list or dict of the items above a MARK, a frozenset):
# charged its exact shallow size (sys.getsizeof) after it is built. What one such opcode
# builds is at most a few times the pickle's size.
_SIZED_OPS = frozenset(op[0] for op in (
    pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.UNICODE,
    pickle.BINBYTES, pickle.SHORT_BINBYTES, pickle.BINBYTES8, pickle.BYTEARRAY8,
    pickle.BINSTRING, pickle.SHORT_BINSTRING, pickle.STRING, pickle.LONG, pickle.LONG1,
    pickle.LONG4, pickle.INT, pickle.BININT, pickle.BININT2, pickle.FLOAT, pickle.BINFLOAT,
    pickle.LIST, pickle.DICT, pickle.FROZENSET, pickle.EMPTY_LIST, pickle.EMPTY_DICT))

# Opcodes that call a callable with an argument tuple from the stack: CPython copies the
# tuple into the callee's ``*args`` (8 bytes an item) before the callee runs.
_CALL_OPS = frozenset(op[0] for op in (pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX))

_TUPLE_OPS = frozenset(op[0] for op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3))

# Memo entries: a dict slot, its hash table share and the int key.
_MEMO_OPS = frozenset(op[0] for op in (pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE))
_MEMO_BYTES = 64

_SLOT = 8  # a reference on the stack


class _Memo:
    """The unpickler's memo, a mapping from index to object, as compact as a list where
    the indices come in order (torch.save's pickles: a ZeRO-3 model file of 100,000
    parameters memoizes about a million objects, and a dict of them with their int keys
    cost 70 bytes an entry, a list 8), and a dict for indices that do not."""

    __slots__ = ("_items", "_other")

    def __init__(self):
        self._items: list = []
        self._other: dict = {}

    def __len__(self) -> int:
        return len(self._items) + len(self._other)

    def __setitem__(self, index: int, value) -> None:
        items = self._items
        if 0 <= index < len(items):
            items[index] = value
        elif index == len(items):
            self._other.pop(index, None)
            items.append(value)
        else:
            self._other[index] = value

    def __getitem__(self, index: int):
        if 0 <= index < len(self._items):
            return self._items[index]
        return self._other[index]  # KeyError: the unpickler says "Memo value not found"

    def __contains__(self, index: int) -> bool:
        return 0 <= index < len(self._items) or index in self._other

    def clear(self) -> None:
        self._items.clear()
        self._other.clear()


class BoundedUnpickler(pickle._Unpickler):
    """Pure Python unpickler that refuses a pickle costing more than ``budget`` bytes.

    Args:
        data: the whole pickle (bytes); lengths in it are checked against its size.
        budget: bytes of objects the pickle may build (an estimate; an upper bound of the
            real cost).

    Subclasses resolve globals (``find_class``) and charge what their callables copy with
    ``charge(nbytes)`` before copying.
    """

    BUILD_TYPES: tuple[type, ...] = ()

    # Tuples nested inside tuples (subclasses set their cap): hashing a tuple recurses in C
    # without a depth check, so a deep one crashes the interpreter.
    MAX_TUPLE_NESTING = 100

    def __init__(self, data: bytes, budget: int):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self.data_bytes = len(data)
        self.budget = budget
        self.charged = 0
        self.dispatch = _PRICED
        self.memo = _Memo()
        self._tuple_depth: dict[int, int] = {}  # id of a tuple built here -> its nesting

    def charge(self, nbytes: int) -> None:
        """Add ``nbytes`` (bytes about to be built) to the cost; raise past the budget."""
        self.charged += nbytes
        if self.charged > self.budget:
            raise pickle.UnpicklingError(
                f"the pickle builds more than {self.budget} bytes of objects (at byte "
                f"{self._position()} of {self.data_bytes}); refusing it")

    def _position(self) -> int:
        return self._stream.tell()

    def _check_tuple(self) -> None:
        """Record the nesting of the tuple just pushed; refuse one nested too deep."""
        top = self.stack[-1]
        if type(top) is not tuple or not top:
            return
        depth = 1 + max((self._tuple_depth.get(id(x), 1) for x in top if type(x) is tuple), default=0)
        if depth > self.MAX_TUPLE_NESTING:
            raise pickle.UnpicklingError(f"tuples nested more than {self.MAX_TUPLE_NESTING} deep")
        if depth > 1:  # a flat tuple is the default: only nested ones take an entry
            self.charge(100)
            self._tuple_depth[id(top)] = depth

    # -- opcodes replaced ---------------------------------------------------------------------

    def load_bytearray8(self):
        # the stock opcode allocates the declared length before reading a byte
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self.data_bytes:
            raise pickle.UnpicklingError(
                f"BYTEARRAY8 of {n} bytes in a pickle of {self.data_bytes} bytes")
        self.charge(n)
        b = bytearray(n)
        self.readinto(b)
        self.append(b)

    def load_build(self):
        inst = self.stack[-2]
        if not isinstance(inst, self.BUILD_TYPES):
            raise pickle.UnpicklingError(
                f"BUILD (setting the state) of a {type(inst).__name__}, which is not allowed")
        state = self.stack[-1]
        parts = state if isinstance(state, tuple) else (state,)
        # a dict state is copied into the object's __dict__: charge its entries
        self.charge(OPCODE_BYTES * sum(len(p) for p in parts if isinstance(p, dict)))
        pickle._Unpickler.load_build(self)


def _priced(op: int, func):
    """``func`` (an opcode's handler) wrapped to charge what it builds."""
    if op in _SIZED_OPS or op in _TUPLE_OPS:
        def run(self):
            self.charge(_REFERENCE_BYTES)
            func(self)
            self.charge(_SLOT + sys.getsizeof(self.stack[-1]))
            if op in _TUPLE_OPS:
                self._check_tuple()
        return run
    if op in _CALL_OPS:
        def run(self):
            args = self.stack[-1]
            self.charge(_FIXED[op] + _SLOT * (len(args) if isinstance(args, (tuple, list, dict)) else 0))
            func(self)
        return run
    if op in _GROW:
        per_item = _GROW[op]
        if op in _GROW_ALL:
            def run(self):
                self.charge(_REFERENCE_BYTES + per_item * len(self.stack))
                func(self)
        else:
            def run(self):
                self.charge(_REFERENCE_BYTES + per_item)
                func(self)
        return run
    if op in _REFERENCE_OPS:
        cost = _REFERENCE_BYTES
    elif op in _MEMO_OPS:
        cost = _MEMO_BYTES
    else:
        cost = _FIXED.get(op, OPCODE_BYTES)

    def run(self):
        self.charge(cost)
        func(self)
    return run


def _priced_table() -> dict:
    table = {}
    for op, func in pickle._Unpickler.dispatch.items():
        name = func.__name__
        func = getattr(BoundedUnpickler, name, func)  # our replacements
        table[op] = _priced(op, func)
    return table


_PRICED = _priced_table()
