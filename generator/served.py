"""An adapter version served as a vLLM LoRA adapter (generator.lora_mode: adapter), inside each vLLM worker: the
other strategy beside generator/merge.py's merge.

Each version is registered from the tensors received (no files) as its own adapter, id version + 1, in the worker's
LoRA manager, where vLLM's scheduler finds it when a request names it: the engine (generator/engine.py) gives every
new request the newest version's adapter, and a running request keeps its own to its end, so a sample's behaviour
version is exact (first = last). vLLM packs q/k/v and gate/up itself (`LoRAModel.from_lora_tensors`). The version's
lora_B is already scaled (learner/adapters.py), so the adapter is declared with lora_alpha = r: scale 1. A version
gets a new id: vLLM's prefix cache keys on the id, and reusing one would reuse the old adapter's KV. Adapters no
running request uses and not the newest are removed (`keep`).
"""

from __future__ import annotations

from weights.plan import LORA_A, PEFT_PREFIX  # vLLM parses PEFT's tensor names


class ServedAdapters:
    def __init__(self, worker):
        self.worker = worker
        self.next_id: int | None = None  # the id the next version gets (the engine sets it before each load)

    def add(self, named: list) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        if self.next_id is None:
            raise RuntimeError("generator.lora_mode adapter: a version arrived without its adapter id")
        manager = self.worker.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        cache = manager._adapter_manager  # its adapters in CPU memory, where requests find them by id
        rank = next(t.shape[0] for n, t in named if n.endswith(LORA_A))
        targets = sorted({n.removesuffix(LORA_A).rsplit(".", 1)[-1] for n, _ in named if n.endswith(LORA_A)})
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": targets,
                                       "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = cache.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            self.next_id, {PEFT_PREFIX + n: t for n, t in named}, helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=_names_only(mapper),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        cache.remove_adapter(self.next_id)  # a learner that resumed sends a version again: its tensors now
        if len(cache) + 1 > cache.capacity:
            raise RuntimeError(f"generator.lora_mode adapter: {len(cache)} adapters in use fill the engine's "
                               f"{cache.capacity} (max_cpu_loras)")
        cache.add_adapter(lora)
        self.next_id = None

    def keep(self, ids: list[int]) -> list[int]:
        """Remove every adapter but `ids`; returns those left."""
        cache = self.worker.model_runner.lora_manager._adapter_manager
        for lora_id in list(cache.list_adapters()):
            if lora_id not in ids:
                cache.remove_adapter(lora_id)
        return sorted(cache.list_adapters())


def _names_only(mapper):
    """The model's checkpoint-to-vLLM name mapper without its packing (q_proj stays q_proj: LoRA names modules, it
    does not load them), as vLLM's LoRA loader takes it: `get_rename_mapper` since vLLM 0.3x, `get_unstacked_mapper`
    in 0.26 (the GPU build)."""
    if mapper is None:
        return None
    return (getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper)()
