"""A shared-memory region for PagedAttention's tensors (client/shared_memory.h).

A memfd sealed against shrinking and growing, mapped here; the server maps
it by `path` (/proc/<pid>/fd/<fd>) once Client.register_shared_memory
registers it, which works for a client on the server's host over a unix
socket. Client.paged_attention(..., shm=region) then puts the query, key and
value there and takes the output from there instead of sending them in the
messages.
"""

import fcntl
import mmap
import os

import numpy as np


class SharedMemory:
    """`size` bytes of shared memory (zero-filled)."""

    def __init__(self, size):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        fd = os.memfd_create("kvstep", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW |
                        fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.size = size
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.region_id = 0  # set by Client.register_shared_memory

    def array(self, offset, shape, dtype):
        """A numpy view of the region's bytes from `offset`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + count * dtype.itemsize > self.size:
            raise ValueError(
                f"{count * dtype.itemsize} bytes at offset {offset} do not fit "
                f"the region's {self.size}")
        return np.frombuffer(self._map, dtype=dtype, count=count,
                             offset=offset).reshape(shape)

    def close(self):
        """Unmaps the region here (the server keeps its own mapping until
        it is unregistered)."""
        if self._map is not None:
            self._map.close()
            self._map = None
            os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
