"""What reading a ``torch.save`` file (a DeepSpeed rank file) may cost: every cap of the .pt
reader in one place, each with its reason. docs/untrusted-input.md lists them with the
errors a user sees.

A .pt file is untrusted input: anyone can hand us one. The figures below are far above what
real DeepSpeed checkpoints need (a ZeRO-3 model-states file of a 47,000-parameter MoE model
has an 8 MB ``data.pkl`` and 50,000 zip records) and far below what would exhaust a
machine.
"""

from __future__ import annotations

from ..units import MiB

# -- the zip container -------------------------------------------------------------------------

# Records (zip entries) in one file. ``zipfile`` builds an object of about 900 bytes per
# entry of the central directory before we see any: 2 million entries cost 1.9 GB of RSS
# and 78 s. A rank file holds data.pkl, a few small records and one record per tensor
# storage (model states: one per parameter; a 70B Llama has 723, a ZeRO-3 MoE model with
# 100,000 per-expert weights 100,006, which torch.save writes with zip64 end records).
# MAX_CENTRAL_DIRECTORY below bounds what a forged directory can make zipfile build.
MAX_RECORDS = 262_144

# Bytes of the central directory (the zip's list of entries; 46 bytes + the name per entry).
# Checked before ``zipfile`` parses it: this, not the entry count the zip declares (which a
# forged file may understate), bounds what zipfile builds (at most ~350,000 entries of a
# 1-character name, ~330 MB). 65,536 real entries take about 6 MB.
MAX_CENTRAL_DIRECTORY = 16 * MiB

# Bytes of ``data.pkl``, the pickled object tree (read into memory whole). torch.save writes
# it uncompressed, so a compressed data.pkl is refused outright rather than inflated (a
# 4.2 MB deflated record inflates to 4.3 GB). A real data.pkl over ~10 MB would exceed
# MAX_UNPICKLE_BYTES anyway; this cap refuses a bigger one before reading it.
MAX_PICKLE_BYTES = 32 * MiB

# Bytes of any other small record read into memory (``byteorder`` holds "little").
MAX_SMALL_RECORD = 4096

# -- unpickling data.pkl ------------------------------------------------------------------------

# Estimated bytes of the objects unpickling may build (``bounded_unpickler`` charges every
# opcode an upper bound of what it builds, and the allow-listed callables the copies they
# make, before or as they run). The estimate is about 3 times the real cost for a real
# DeepSpeed data.pkl (35 bytes estimated per byte of pickle), and about the real cost for
# a pickle of nothing but empty sets: this keeps a hostile pickle under ~450 MiB of RSS and
# accepts a real data.pkl of up to ~10 MB.
MAX_UNPICKLE_BYTES = 384 * MiB

# Tuples nested inside tuples. Hashing a tuple (as a dict key or set member) recurses in C
# without a depth check: a pickle of a tuple nested a million deep (1 MB) crashes the
# interpreter. Real checkpoints nest fewer than 10.
MAX_TUPLE_NESTING = 100

# Distinct class names (DeepSpeed, numpy, argparse...) a pickle may name: each becomes a
# stand-in class of about 1 KB. A DeepSpeed file names fewer than 10.
MAX_INERT_CLASSES = 1024

# -- tensors ------------------------------------------------------------------------------------

# Dimensions of one tensor: the most torch itself allows (``c10``'s dimension limit is 64
# in kernels; more would only make products of sizes slow to compute).
MAX_NDIM = 64

# A size, stride, offset or element count: torch stores them as int64.
MAX_EXTENT = (1 << 63) - 1

# Characters of a storage key (torch.save writes the decimal index of the storage).
MAX_STORAGE_KEY = 1024
