"""The plan of a weights version, shared by the learner and the generators: what travels, in which order.

A version is the model's named tensors. The file transports carry it as one safetensors blob (`serialize`)
with a crc32 (`checksum`); the nccl transport as a few flat broadcasts of about BUCKET_BYTES each, in the
order of a manifest ([name, dtype, shape] per tensor) that both sides turn into the same buckets (`buckets`,
`Packer` on the learner, `unpack` on the generator's workers).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

BUCKET_BYTES = 256 * 2**20
ALIGN = 16  # every tensor starts at a multiple of this many bytes inside its bucket
# An adapter version (model.lora; learner/versions.py) names lora_A and lora_B after the base weight they change:
# `X.lora_A.weight` and `X.lora_B.weight` for `X.weight`. PEFT's own names put its wrapper's prefix before them
# (what vLLM's LoRA loader parses: generator/served.py).
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
PEFT_PREFIX = "base_model.model."


def nbytes(dtype: str, shape: list) -> int:
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def is_adapter(entries: Iterable[Sequence[Any]]) -> bool:
    """Whether a version, as (name, tensor) pairs or as its manifest ([name, dtype, shape]), is an adapter version."""
    return any(name.endswith(LORA_A) for name, *_ in entries)


def buckets(manifest: list) -> list[tuple[list[int], list[int], int]]:
    """Consecutive manifest entries grouped into broadcasts of about BUCKET_BYTES (a larger tensor alone):
    [(entry indices, their byte offsets, bucket size)]. Learner and generators compute the same plan."""
    plan, idx, offs, size = [], [], [], 0
    for i, (_, dtype, shape) in enumerate(manifest):
        idx.append(i)
        offs.append(size)
        size += -(-nbytes(dtype, shape) // ALIGN) * ALIGN
        if size >= BUCKET_BYTES:
            plan.append((idx, offs, size))
            idx, offs, size = [], [], 0
    if idx:
        plan.append((idx, offs, size))
    return plan


def unpack(flat: torch.Tensor, manifest: list, idx: list[int], offs: list[int]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket."""
    out = []
    for i, off in zip(idx, offs, strict=True):
        name, dtype, shape = manifest[i]
        n = nbytes(dtype, shape)
        out.append((name, flat[off:off + n].view(getattr(torch, dtype)).view(shape)))
    return out


def unpack_all(flats: list[torch.Tensor], manifest: list, plan: list) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a whole version, from its buckets' flats in order (plan: `buckets(manifest)`)."""
    return [nt for (idx, offs, _), flat in zip(plan, flats, strict=True) for nt in unpack(flat, manifest, idx, offs)]


class Packer:
    """Copies tensors (in manifest order, as they are gathered) into flat buckets on `device`; each full bucket
    goes to `emit(flat, idx, offs)` (broadcast, CPU copy). ZeRO-3 may release a parameter once it is added:
    the copy is queued on the current stream, ahead of any reuse of its memory."""

    def __init__(self, manifest: list, device: torch.device | str,
                 emit: Callable[[torch.Tensor, list[int], list[int]], None]) -> None:
        self.plan, self.device, self.emit = buckets(manifest), device, emit
        self.k, self.n = 0, 0
        self.flat: torch.Tensor | None = None  # the bucket being filled

    def add(self, t: torch.Tensor) -> None:
        idx, offs, size = self.plan[self.k]
        if self.flat is None:
            self.flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        nbytes = t.numel() * t.element_size()
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self.flat[offs[self.n]:offs[self.n] + nbytes].copy_(src, non_blocking=True)
        self.n += 1
        if self.n == len(idx):
            self.emit(self.flat, idx, offs)
            self.k, self.n, self.flat = self.k + 1, 0, None

    def pack(self, tensors: Iterable[torch.Tensor]) -> None:
        """A whole version at once (a joiner's, from the CPU copy): add each, then finish."""
        for t in tensors:
            self.add(t)
        self.finish()

    def finish(self) -> None:
        if self.k != len(self.plan):  # the generators would wait for the rest until their timeout
            raise RuntimeError(f"nccl transport: {self.k} of {len(self.plan)} buckets sent; parameters differ "
                               "from the announced manifest")


def manifest(named: Iterable[tuple[str, torch.Tensor]]) -> list[list]:
    """[name, dtype, shape] of (name, tensor) pairs in broadcast order (ZeRO-3 parameters: the full shape)."""
    return [[name, str(t.dtype).removeprefix("torch."), list(getattr(t, "ds_shape", t.shape))] for name, t in named]


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def serialize(named_tensors: Iterable[tuple[str, torch.Tensor]],
              buffer: Callable[[int], bytearray | mmap.mmap] = bytearray) -> bytearray | mmap.mmap:
    """(name, tensor) pairs -> one safetensors blob, each tensor copied once into a buffer of the final size
    (safetensors.torch.save copies each two or three times: for the 0.5B shape on 2 cores, 2.0 s against 0.78 s
    in `python -m bench.serialize_blob`, on the learner's path at max_staleness >= 1). Tensors in safetensors'
    order: wider dtypes first, then by name, so each starts aligned to its element size. `buffer(size)` makes
    the writable buffer it fills and returns (weights.files.serialize_to_shm: a memory-mapped file)."""
    tensors = sorted(((name, t.detach().to("cpu").contiguous()) for name, t in named_tensors),
                     key=lambda nt: (-nt[1].element_size(), nt[0]))
    header, size = {}, 0
    for name, t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"weights: {name} has dtype {t.dtype}, which the file transports do not carry")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [size, size + n]}
        size += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    blob = buffer(8 + len(head) + size)
    blob[:8] = len(head).to_bytes(8, "little")
    blob[8:8 + len(head)] = head
    if size:
        data = torch.frombuffer(blob, dtype=torch.uint8, offset=8 + len(head))
        for name, t in tensors:
            start, end = header[name]["data_offsets"]
            data[start:end].copy_(t.reshape(-1).view(torch.uint8))
    return blob


CRC_SEGMENT = 64 * 2**20  # bytes per thread of `checksum`


def checksum(blob: bytes | bytearray | mmap.mmap) -> int:
    """zlib's crc32 of `blob`, its segments summed in threads (crc32 releases the GIL) and combined: a version of
    the 0.5B shape is 1 GB, whose crc32 took 440 ms on one core, on the learner's and the generator's side."""
    view = memoryview(blob).cast("B")
    starts = range(0, len(view), CRC_SEGMENT)
    if len(starts) < 2:
        return zlib.crc32(view)
    workers = min(len(starts), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers, thread_name_prefix="crc32") as pool:
        crcs = list(pool.map(lambda i: zlib.crc32(view[i:i + CRC_SEGMENT]), starts))
    crc = crcs[0]
    for i, part in zip(starts[1:], crcs[1:], strict=True):
        crc = crc32_combine(crc, part, min(CRC_SEGMENT, len(view) - i))
    return crc


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine: appending len2 zero bytes
    to A is a linear map over GF(2), applied by repeated squaring)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    for _ in range(3):  # eight: one zero byte
        op = _gf2_square(op)
    while len2 > 0:  # then 2, 4, 8... bytes: apply those of len2's bits
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
        if len2:
            op = _gf2_square(op)
    return crc1 ^ crc2


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, row) for row in mat]
