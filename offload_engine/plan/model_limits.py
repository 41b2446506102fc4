"""What reading a model description for ``plan --model`` may cost: every cap in one place,
each with its reason. docs/untrusted-input.md lists them with the errors a user sees.

A config.json, shape list or safetensors header is untrusted input: its numbers are
checked before anything proportional to them is built (the parameter list a config
expands to, the buckets a plan lays out).
"""

from __future__ import annotations

from ..units import MiB

# Bytes of a JSON model description (config.json, shape list, safetensors index) read
# into memory. Real ones are a few KB; an index of a 1000-shard model is about 5 MB.
MAX_JSON_BYTES = 64 * MiB

# Parameter tensors in one model. A config expands to layers x tensors per layer (x experts):
# checked before the list is built. The biggest public models have ~100,000 (DeepSeek-V3:
# 61 layers x 256 experts x 3).
MAX_TENSORS = 1_000_000

# Dimensions of one shape (torch's kernels handle at most 64 too), and a size in one
# dimension: torch counts elements as int64.
MAX_NDIM = 64
MAX_DIM = (1 << 63) - 1

# Buckets of one state array the planner lays out (model elements x 4 bytes / --bucket-bytes):
# it builds an object per bucket, ~90 bytes each. 2,000,000 is a 30-trillion-parameter model
# at the default 64 MiB buckets (165 MB and 10 s of planning).
MAX_PLAN_BUCKETS = 2_000_000

# JSON values of a model description, counted by their separators before parsing (parsing
# builds 30 to 100 bytes of objects per value: 64 MiB of `[{},{},...]` would build 1.5 GB).
# A shape list of 1,000,000 two-dimensional tensors holds about 3,000,000; a real index of
# 10,000 tensors about 20,000.
MAX_JSON_VALUES = 4_000_000
