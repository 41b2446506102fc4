"""Bytes between memory and disk at device speed: aligned buffer pool and async file I/O."""

from .align import ALIGN, aligned_host_buffer, as_byte_view, round_up
from .buffer_pool import BufferPool, PooledBuffer
from .direct_probe import probe_direct
from .errors import (FileIOError, PoolError, PoolExhaustedError, RequestTooLargeError,
                     TruncatedFileError)
from .file_io import AsyncFileIO
from .requests import IOFuture, IOStats

__all__ = [
    "ALIGN", "AsyncFileIO", "BufferPool", "FileIOError", "IOFuture", "IOStats", "PoolError",
    "PoolExhaustedError", "PooledBuffer", "RequestTooLargeError", "TruncatedFileError",
    "aligned_host_buffer", "as_byte_view", "probe_direct", "round_up",
]
