"""Delta sync for the zmq transport: a version as what changed since the version before, compressed.

Two consecutive versions' safetensors blobs have the same layout (names, dtypes, shapes, offsets), so the XOR of
their bytes is zero wherever an element did not change; after an optimizer step at a small learning rate most
bf16 elements are unchanged, and zlib packs the zeros away. A generator holding the previous version's file
fetches the delta, XORs it onto that file and checks the result against the announced crc32 of the full blob;
one that is further behind, holds no file, or fails the check fetches the full blob (`weights.delta`).
The blob is XORed and compressed in chunks of CHUNK bytes on up to THREADS threads (numpy and zlib release the GIL):
a delta is a count, each chunk's compressed length (uint32 each), then the chunks.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 16 * 2**20
THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))


def encode(base: bytes | bytearray | mmap.mmap, new: bytes | bytearray | mmap.mmap) -> bytes | None:
    """The delta from `base` to `new`, or None when their layouts differ (then only the full blob will do)."""
    if len(base) != len(new) or _header(base) != _header(new):
        return None
    old, cur = np.frombuffer(base, np.uint8), np.frombuffer(new, np.uint8)

    def chunk(start: int) -> bytes:
        return zlib.compress(np.bitwise_xor(old[start:start + CHUNK], cur[start:start + CHUNK]).data, 1)

    with ThreadPoolExecutor(THREADS) as pool:
        chunks = list(pool.map(chunk, range(0, len(cur), CHUNK)))
    return struct.pack(f"<I{len(chunks)}I", len(chunks), *map(len, chunks)) + b"".join(chunks)


def apply(base: bytes | bytearray | mmap.mmap, delta: bytes | bytearray) -> np.ndarray:
    """`base` with `delta` applied (buffers): the new version's blob, as bytes in an array."""
    old, diff = np.frombuffer(base, np.uint8), memoryview(delta)
    (count,) = struct.unpack_from("<I", diff)
    if count != -(-len(old) // CHUNK) or 4 * (count + 1) > len(diff):  # before the count sizes anything
        raise ValueError(f"a delta of {count} chunks ({len(diff)} bytes) for a base of {len(old)} bytes")
    sizes = struct.unpack_from(f"<{count}I", diff, 4)
    if 4 * (count + 1) + sum(sizes) != len(diff):
        raise ValueError(f"a delta of {count} chunks ({len(diff)} bytes) for a base of {len(old)} bytes")
    offsets = np.cumsum((4 * (count + 1), *sizes))
    out = np.empty_like(old)

    def chunk(i: int) -> None:
        xor = np.frombuffer(zlib.decompress(diff[offsets[i]:offsets[i + 1]]), np.uint8)
        start = i * CHUNK
        if len(xor) != len(old[start:start + CHUNK]):
            raise ValueError(f"delta chunk {i}: {len(xor)} bytes, the base has {len(old[start:start + CHUNK])}")
        np.bitwise_xor(old[start:start + CHUNK], xor, out=out[start:start + CHUNK])

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(chunk, range(count)))
    return out


def _header(blob: bytes | bytearray | mmap.mmap) -> bytes | bytearray:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[:8 + n]
