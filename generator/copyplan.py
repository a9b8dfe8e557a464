"""vLLM's weight loading, recorded once as plain copies and replayed for every later version.

`model.load_weights` maps checkpoint names onto vLLM's parameters in Python, tensor by tensor (stacked
q/k/v and gate/up, tensor-parallel shards, padded vocabularies). With the nccl transport's staging
buffers every version arrives at the same addresses, so those copies are the same every time: `record`
runs the load once under a dispatch mode and keeps each copy (and constant fill) into a parameter;
`replay` redoes them, one kernel each and no name mapping. A load that does anything else to a parameter
(computes into it, indexes, writes its source, rebinds its storage) cannot be replayed: `record` says why,
and the caller keeps using load_weights. `sums` lets the caller check a replay against load_weights once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def record(load: Callable[[], object], sources: list[torch.Tensor],
           params: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, torch.Tensor | float]], str]:
    """Run `load` (which reads `sources`, writes `params`) and return ([(destination view, source view or
    fill value)], "") in order, or ([], why it cannot be replayed)."""
    src_ptrs = {_storage(s) for s in sources}
    param_ptrs = {_storage(p) for p in params}
    ops: list[tuple[torch.Tensor, torch.Tensor | float]] = []
    refused: list[str] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for i, spec in enumerate(func._schema.arguments):
                if spec.alias_info is None or not spec.alias_info.is_write:
                    continue
                t = args[i] if i < len(args) else kwargs.get(spec.name)
                if not isinstance(t, torch.Tensor):
                    continue
                if _storage(t) in src_ptrs:
                    refused.append(f"{func} writes a received tensor")
                elif _storage(t) not in param_ptrs:
                    continue
                elif func is torch.ops.aten.copy_.default and _storage(args[1]) in src_ptrs:
                    ops.append((t, args[1]))
                elif func in FILLS:
                    ops.append((t, args[1] if len(args) > 1 else 0))
                else:
                    refused.append(f"{func} writes a parameter")
            return func(*args, **kwargs)

    before = [_storage(p) for p in params]
    with torch.no_grad(), Recorder():
        load()
    if [_storage(p) for p in params] != before:
        refused.append("the load replaced a parameter's storage")
    if not ops:
        refused.append("the load copied nothing from the received tensors")
    return ([], "; ".join(sorted(set(refused)))) if refused else (ops, "")


def replay(ops: list[tuple[torch.Tensor, torch.Tensor | float]]) -> None:
    with torch.no_grad():
        for dst, src in ops:
            if isinstance(src, torch.Tensor):
                dst.copy_(src, non_blocking=True)
            else:
                dst.fill_(src)


def sums(params: list[torch.Tensor]) -> torch.Tensor:
    """One float64 sum per parameter (a replay that missed a copy leaves a parameter's old values)."""
    with torch.no_grad():
        return torch.stack([torch.sum(p, dtype=torch.float64) for p in params])
