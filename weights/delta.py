"""Delta sync for the zmq transport: a version as what changed since the version before, compressed.

Two consecutive versions' safetensors blobs have the same layout (names, dtypes, shapes, offsets), so the XOR of
their bytes is zero wherever an element did not change; after an optimizer step at a small learning rate most
bf16 elements are unchanged, and zlib packs the zeros away. A generator holding the previous version's file
fetches the delta, XORs it onto that file and checks the result against the announced crc32 of the full blob;
one that is further behind, holds no file, or fails the check fetches the full blob (`weights.delta`).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np


def encode(base: bytes, new: bytes) -> bytes | None:
    """The delta from `base` to `new`, or None when their layouts differ (then only the full blob will do)."""
    if len(base) != len(new) or _header(base) != _header(new):
        return None
    xor = np.bitwise_xor(np.frombuffer(base, np.uint8), np.frombuffer(new, np.uint8))
    return zlib.compress(xor.data, 1)


def apply(base, delta: bytes) -> bytes:
    """`base` (bytes or a buffer) with `delta` applied: the new version's blob."""
    xor = np.frombuffer(zlib.decompress(delta), np.uint8)
    base = np.frombuffer(base, np.uint8)
    if len(xor) != len(base):
        raise ValueError(f"delta of {len(xor)} bytes for a base of {len(base)} bytes")
    return np.bitwise_xor(base, xor).tobytes()


def _header(blob: bytes) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[:8 + n]
