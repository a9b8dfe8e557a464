"""How long the file transports take to serialise a version: `weights.plan.serialize` (each tensor copied once
into a buffer of the final size) against `safetensors.torch.save`, then the /dev/shm write, and
`serialize_to_shm` (serialised straight into the shm file: what the shm transport does); the crc32 in one
thread (zlib) and in segments on several (`weights.plan.checksum`); for models of Qwen2.5 shapes (bf16, CPU
tensors as the learner's CPU copy holds them).

    python -m bench.serialize_blob [--sizes 0.5b,1.5b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import qwen_shaped_config, result_name, write_result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5b")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import zlib

    from safetensors.torch import save
    from transformers import Qwen2ForCausalLM

    from weights.files import remove_shm, serialize_to_shm, write_shm
    from weights.plan import checksum, serialize

    out = {}
    for size in args.sizes.split(","):
        with torch.device("meta"):
            shapes = [(n, p.shape) for n, p in Qwen2ForCausalLM(qwen_shaped_config(size)).named_parameters()]
        named = [(n, torch.ones(shape, dtype=torch.bfloat16)) for n, shape in shapes]
        times = {"safetensors_save_ms": [], "serialize_ms": [], "write_shm_ms": [], "crc32_one_thread_ms": [],
                 "crc32_ms": [], "serialize_to_shm_ms": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            old = save({n: t for n, t in named})
            t1 = time.perf_counter()
            blob = serialize(named)
            t2 = time.perf_counter()
            write_shm("bench-serialize", 0, blob)
            t3 = time.perf_counter()
            zlib.crc32(blob)
            t4 = time.perf_counter()
            checksum(blob)
            t5 = time.perf_counter()
            remove_shm("bench-serialize")
            serialize_to_shm("bench-serialize", 1, named)
            t6 = time.perf_counter()
            assert len(old) == len(blob)
            del old, blob
            remove_shm("bench-serialize")
            for key, ms in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
                times[key].append(ms * 1000)
        remove_shm("bench-serialize")
        out[size] = {key: round(statistics.median(v), 1) for key, v in times.items()}
        out[size]["bytes"] = sum(t.numel() * 2 for _, t in named)
        print(size, out[size], flush=True)
    write_result(result_name("serialize_blob", args.sizes, gpus=False), "python -m bench.serialize_blob "
                 + " ".join(sys.argv[1:]), f"Qwen2.5 shapes {args.sizes}, bf16", out,
                 threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    sys.exit(main())
