import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest

from pipeline.config import ConfigError, config_from_dict, load_config
from pipeline.environment import apply_environment
from pipeline.runtime_knobs import apply_runtime_change, runtime_keys


def test_defaults_are_the_embedded_demo():
    cfg = load_config()
    assert cfg.model.path == "builtin:tiny"
    assert cfg.data.path == "builtin:echo"
    assert cfg.rewards[0].fn == "builtin:echo_reward"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_staleness: 3\n  lr: 1e-4\ngenerator:\n  update_mode: drain\n")
    cfg = load_config(path, ["trainer.max_staleness=2", "sampling.temperature=0.7"])
    assert cfg.trainer.max_staleness == 2  # command line beats the file
    assert cfg.trainer.lr == 1e-4  # YAML's "1e-4" string is read as a float
    assert cfg.generator.update_mode == "drain"
    assert cfg.sampling.temperature == 0.7


@pytest.mark.parametrize("data, overrides, message", [
    ({"trainer": {"max_stalness": 1}}, [], "trainer.max_stalness: unknown field (did you mean max_staleness?)"),
    ({}, ["trainer.batch_size=many"], "trainer.batch_size: expected int, got 'many'"),
    ({}, ["trainer.max_staleness=-1"], "trainer.max_staleness: must be in [0, 1000000]"),
    ({}, ["trainer.loss=reinforce"], "trainer.loss: 'reinforce' is not one of"),
    ({}, ["generator.enforce_eager=3"], "generator.enforce_eager: expected true or false"),
    ({"rewards": [{"fn": "nocolon"}]}, [], "rewards[0].fn: expected 'module:function'"),
    ({"rewards": [{"fnn": "a:b"}]}, [], "rewards[0].fnn: unknown field"),
    ({}, ["trainer.group_size=1"], "trainer.group_size: must be >= 2"),
    ({}, ["sampling.temperature=0"], "sampling.temperature: must be in (0, 10]"),
    ({}, ["sampling.top_p=0.9"], "sampling.top_p: must be 1.0, got 0.9: vLLM's behaviour log-probs are taken after"),
    ({}, ["trainer.lr=inf"], "trainer.lr: must be a finite number, got inf"),
    ({}, ["trainer.lr=.nan"], "trainer.lr: must be a finite number, got nan"),
    ({}, ["rewards=[{fn: 'a:b', weight: .inf}]"], "rewards[0].weight: must be a finite number"),
    ({}, ["sampling.top_p=0"], "sampling.top_p: must be in (0, 1]"),
    ({}, ["trainer.clip_eps=1.5"], "trainer.clip_eps: must be in (0, 1]"),
    ({}, ["hub.port=70000"], "hub.port: must be in [0, 65535]"),
    ({}, ["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints: must be >= 1"),
    ({}, ["sampling.max_tokens=256"], "sampling.max_tokens: 256 leaves no room for a prompt"),
    ({}, ["hub.heartbeat_timeout_s=0.5"], "hub.heartbeat_timeout_s: must exceed hub.heartbeat_s"),
    ({}, ["generator.gpu_memory_utilization=1.5"], "generator.gpu_memory_utilization: must be in (0, 1]"),
    ({}, ["trainer.gpu_memory_gb=-1"], "trainer.gpu_memory_gb: must be >= 0, got -1.0"),
    ({}, ["trainer.gpu_memory_gb=.inf"], "trainer.gpu_memory_gb: must be a finite number"),
    ({}, ["trainer.gpu_memory_gb=forty"], "trainer.gpu_memory_gb: expected float, got 'forty'"),
    ({"trainer": 5}, [], "trainer: expected a mapping"),
    ({"trainer": {"compile": True, "zero_stage": 3}}, [], "trainer.compile: not with trainer.zero_stage 3"),
    ({"trainer": {"offload_optimizer": True}}, [], "trainer.offload_optimizer: needs trainer.zero_stage 1-3"),
    ({}, ["trainer"], "expected KEY=VALUE"),
    ({}, ["model.lora={r: 0}"], "model.lora.r: must be in [1, 1024]"),
    ({}, ["model.lora={rank: 8}"], "model.lora.rank: unknown field (known: r, alpha"),
    ({}, ["model.lora={lora_alpha: 8}"], "model.lora.lora_alpha: unknown field (did you mean alpha?)"),
    ({}, ["model.lora={dropout: 1.0}"], "model.lora.dropout: must be in [0, 1)"),
    ({}, ["model.lora={target_modules: 5}"], "model.lora.target_modules: expected str, got 5"),
    ({}, ["generator.lora_mode=adapter"], "generator.lora_mode: adapter serves a LoRA adapter, and model.lora is not"),
    ({"data": {"path": "builtin:arithmetic"}}, [], "data.path: 'builtin:arithmetic' is not a builtin dataset (did "
                                                    "you mean builtin:arith?)"),
    ({}, ["eval.data={path: 'builtin:gsm8k'}"], "eval.data.path: 'builtin:gsm8k' is not a builtin dataset"),
    ({}, ["eval.data={path: 'builtin:echo', size: 0}"], "eval.data.size: must be > 0"),  # data.size's range
    ({}, ["generator.rollout=agent", "generator.agent=a:b"],
     "generator.rollout: 'agent' is now named 'builtin:agent', as the other shipped strategies are; write "
     "generator.rollout: builtin:agent"),
    ({}, ["generator.rollout=environment"], "generator.rollout: 'environment' is now named 'builtin:environment'"),
    ({}, ["generator.rollout=single_turn"], "generator.rollout: expected 'module:function' or 'builtin:NAME'"),
    ({}, ["generator.rollout=builtin:agent"], "generator.rollout builtin:agent: set one of generator.agent"),
    ({"generator": {"rollout": "builtin:agent", "agent": "a:b", "agent_command": ["x"]}}, [], "not both"),
    ({}, ["generator.agent=a:b"], "generator.agent / agent_command: set, but generator.rollout is"),
    ({}, ["generator.rollout=builtin:agent", "generator.agent=my_agent"],
     "generator.agent: expected 'module:function'"),
    ({}, ["generator.rollout=builtin:agent", "generator.agent=a:b", "generator.agent_timeout_s=0"],
     "generator.agent_timeout_s: must be"),
    ({}, ["generator.agent_failure=retry"], "generator.agent_failure"),
    ({}, ["generator.lora_mode=adapter", "model.lora={modules_to_save: [lm_head]}"],
     "model.lora.modules_to_save: ['lm_head'] cannot be served as a vLLM LoRA adapter"),
    ({}, ["generator.lora_mode=adapter", "model.lora={r: 600}"], "model.lora.r: 600 is above the largest rank vLLM"),
    ({}, ["model.quantization=4bit"], "model.quantization: 4bit freezes a quantized base, which trains only through "
                                      "adapters (QLoRA): set model.lora too"),
    ({}, ["model.quantization=nf4"], "model.quantization: 'nf4' is not one of '4bit', '8bit'"),
    ({}, ["model.quantization=4bit", "model.lora={}", "trainer.zero_stage=3"],
     "trainer.zero_stage: 3 shards every parameter, and bitsandbytes' quantized weights cannot be sharded"),
])
def test_bad_fields_are_named(data, overrides, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, overrides)
    assert message in str(e.value)


def test_the_learners_gpu_memory_cap_is_gb_and_0_is_none():
    assert config_from_dict({}).trainer.gpu_memory_gb == 0.0
    assert config_from_dict({"trainer": {"gpu_memory_gb": 40}}).trainer.gpu_memory_gb == 40.0
    assert config_from_dict({}, ["trainer.gpu_memory_gb=39.5"]).trainer.gpu_memory_gb == 39.5
    with pytest.raises(ConfigError, match="cannot change while a run goes on"):
        apply_runtime_change(load_config(), "trainer.gpu_memory_gb", 20)  # set before the model loads


def test_lora_takes_peft_target_modules_as_a_name_or_a_list():
    assert config_from_dict({}).model.lora is None
    assert config_from_dict({}, ["model.lora={}"]).model.lora.target_modules == "all-linear"
    data = {"model": {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}}
    lora = config_from_dict(data).model.lora
    assert (lora.r, lora.alpha, lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_runtime_changes():
    cfg = load_config()
    assert "trainer.max_staleness" in runtime_keys() and "trainer.lr" in runtime_keys()
    assert apply_runtime_change(cfg, "trainer.max_staleness", 4) == 4
    assert cfg.trainer.max_staleness == 4
    with pytest.raises(ConfigError, match="cannot change while a run goes on"):
        apply_runtime_change(cfg, "trainer.batch_size", 8)
    with pytest.raises(ConfigError, match="unknown field"):
        apply_runtime_change(cfg, "trainer.nope", 1)
    huge = 2**64 - 1
    for key, value, message in [("trainer.lr", -1.0, r"must be in \(0, 1\]"), ("trainer.lr", float("inf"), "finite"),
                                ("trainer.lr", "inf", "finite"), ("trainer.lr", 1e308, "AdamW moves every weight"),
                                ("trainer.lr", huge, r"must be in \(0, 1\]"),
                                ("sampling.temperature", 0, r"must be in \(0, 10\]"),
                                ("sampling.temperature", 1e6, "close to uniform"),
                                ("trainer.max_staleness", -1, r"must be in \[0, 1000000\]"),
                                ("trainer.max_staleness", huge, "trainer.total_steps or more is no bound"),
                                ("generator.lease_size", 0, r"must be in \[1, 4096\]"),
                                ("generator.lease_size", huge, r"must be in \[1, 4096\]")]:
        with pytest.raises(ConfigError, match=message):
            apply_runtime_change(cfg, key, value)
        with pytest.raises(ConfigError, match=message):  # the same range at load
            config_from_dict({}, [f"{key}={value}"])
    assert cfg.trainer.lr == 2e-3 and cfg.sampling.temperature == 1.0 and cfg.generator.lease_size == 4
    assert apply_runtime_change(cfg, "trainer.max_staleness", 10**6) == 10**6  # "no limit" is a usable value


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _gpu_config(cfg) -> bool:
    """A config meant for GPUs: it places services on GPUs or trains in bf16."""
    return bool(cfg.run.learner_gpus or cfg.run.generator_gpus) or cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_and_gpu_ones_run_the_engine_with_cuda_graphs(path):
    """Every config in configs/ loads; a GPU config runs vLLM with CUDA graphs (`generator.enforce_eager: false`,
    the fast path a user starts from) unless its enforce_eager line gives the measured reason (`# measured: ...`)."""
    cfg = load_config(path)
    assert cfg.trainer.total_steps > 0 and cfg.rewards
    if _gpu_config(cfg) and cfg.generator.enforce_eager:
        lines = [line for line in path.read_text().splitlines() if line.strip().startswith("enforce_eager:")]
        assert lines and "# measured:" in lines[0], f"{path.name}: enforce_eager true without a measured reason"


def test_the_gpu_configs_are_found():
    assert {"gpu-single.yaml", "gpu-qwen-math.yaml"} <= {p.name for p in CONFIGS if _gpu_config(load_config(p))}


def test_quantization_without_bitsandbytes_is_refused_with_the_install_command(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ConfigError, match=r"model.quantization: 8bit needs bitsandbytes >= 0.48 \(found none\): "
                                          "pip install"):
        config_from_dict({}, ["model.quantization=8bit", "model.lora={}"])
    assert config_from_dict({}, ["model.lora={}"]).model.quantization is None


def test_data_options_are_checked_by_the_datasets_config_at_start():
    """data.options: a name the dataset's config does not have, a value its validate() refuses, and options for a
    task that reads none are refused at load, naming the field and the fix."""
    def rg(options, path="builtin:reasoning_gym"):
        return config_from_dict({"data": {"path": path, "name": "basic_arithmetic", "options": options},
                                 "rewards": [{"fn": "builtin:reasoning_gym_reward"}]})

    assert rg({"max_terms": 2}).data.options == {"max_terms": 2}
    with pytest.raises(ConfigError, match=r"data.options: 'max_term' is not a setting of reasoning-gym's "
                                          r"basic_arithmetic \(did you mean max_terms\?\)"):
        rg({"max_term": 2})
    with pytest.raises(ConfigError, match=r"data.options: reasoning-gym's basic_arithmetic refuses .*min_terms"):
        rg({"min_terms": 0})
    with pytest.raises(ConfigError, match=r"data.options: expected a mapping"):
        rg([1, 2])
    with pytest.raises(ConfigError, match=r"data.options: only builtin:reasoning_gym reads dataset settings"):
        config_from_dict({"data": {"path": "builtin:arith", "options": {"max_terms": 2}},
                          "rewards": [{"fn": "builtin:math_answer"}]})


def test_builtin_reasoning_gym_names_one_of_its_datasets_and_needs_the_package(monkeypatch):
    """An unknown data.name (or eval.data.name) is refused at load with the names there are; without the package,
    the data or the reward is refused with the pip command."""
    def rg(*overrides):
        return config_from_dict({"data": {"path": "builtin:reasoning_gym", "name": "chain_sum"}, "eval": {"every": 5},
                                 "rewards": [{"fn": "builtin:reasoning_gym_reward"}]}, overrides)

    assert rg().data.name == "chain_sum" and rg("data.name=null").data.name is None  # None: the task's default
    with pytest.raises(ConfigError, match=r"data.name: 'letter_count' is not a reasoning-gym dataset \(did you mean "
                                          r"letter_counting\?\); there are ab, acre, .*, letter_counting, "):
        rg("data.name=letter_count")
    with pytest.raises(ConfigError, match=r"eval.data.name: 'chainsum' is not a reasoning-gym dataset \(did you mean "
                                          r"chain_sum\?\); there are ab, "):
        rg("eval.data={path: 'builtin:reasoning_gym', name: chainsum}")
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # as if not installed: its import fails
    with pytest.raises(ConfigError, match=r"data.path: builtin:reasoning_gym needs the PyPI package reasoning-gym .*"
                                          r"pip install 'reasoning-gym==0.1.25'"):
        rg()
    with pytest.raises(ConfigError, match=r"rewards\[0\].fn: builtin:reasoning_gym needs the PyPI package"):
        config_from_dict({"rewards": [{"fn": "builtin:reasoning_gym_reward"}]})
    assert config_from_dict({}).data.path == "builtin:echo"  # other tasks do not need it


def test_a_lone_gpu_index_is_accepted_as_the_number_yaml_reads():
    cfg = config_from_dict({}, ["run.learner_gpus=1", "run.generator_gpus=[2, '3,4']"])
    assert cfg.run.learner_gpus == "1" and cfg.run.generator_gpus == ["2", "3,4"]
    with pytest.raises(ConfigError, match="run.learner_gpus"):
        config_from_dict({}, ["run.learner_gpus=true"])


def test_generators_sharing_a_gpu_that_cannot_hold_their_shares_are_refused_at_load():
    # vLLM refuses an engine whose gpu_memory_utilization exceeds the memory free at its start: the second of two
    # generators at 0.85 on one GPU would fail once the first had built
    two = ["run.generators=2", "run.generator_gpus=['1']"]
    with pytest.raises(ConfigError, match=r"0.85 for each of the 2 generators .* GPU 1 is 1.70 of it.* 0.47 or less"):
        config_from_dict({}, [*two, "generator.gpu_memory_utilization=0.85"])
    with pytest.raises(ConfigError, match="on GPU 1 is 1.00"):  # the second generator's turn comes round to GPU 1
        config_from_dict({}, ["run.generators=3", "run.generator_gpus=['1', '2,3']",
                              "generator.gpu_memory_utilization=0.5"])
    assert config_from_dict({}, [*two, "generator.gpu_memory_utilization=0.42"]).run.generators == 2
    assert config_from_dict({}, ["run.generators=2", "run.generator_gpus=['0', '1']",
                                 "generator.gpu_memory_utilization=0.9"]).run.generators == 2  # a GPU each


def test_gpus_count_within_the_cuda_visible_devices_a_user_set(monkeypatch):
    from pipeline.environment import OUTER_GPUS, visible_gpus

    monkeypatch.delenv(OUTER_GPUS, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus("1,2") == "1,2"  # none set: the indices are the GPUs'
    monkeypatch.delenv(OUTER_GPUS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_gpus("1,2") == "5,6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")  # as the process set it: its children count within the outer set
    assert visible_gpus("1,2") == "5,6"
    with pytest.raises(ConfigError, match=r"--gpus 3,4: '4' is not one of the 4 GPUs CUDA_VISIBLE_DEVICES=4,5,6,7 "
                                          r"makes visible; count them from 0 \(0-3\)"):
        visible_gpus("3,4")


def test_a_gpu_outside_cuda_visible_devices_is_refused_at_start(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_OUTER_GPUS"} | {"CUDA_VISIBLE_DEVICES": "0,1"}
    (tmp_path / "cfg.yaml").write_text("{}\n")
    done = subprocess.run([sys.executable, "-m", "pipeline", "learner", "-c", str(tmp_path / "cfg.yaml"), "--gpus",
                           "2", "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--gpus 2: '2' is not one of the 2 GPUs CUDA_VISIBLE_DEVICES=0,1" in done.stderr
    assert not (tmp_path / "run").exists()


def test_shipped_functions_have_builtin_names_and_their_old_paths_load_with_a_warning():
    """issue 43: configs name shipped functions `builtin:NAME`; the module paths of before still work, becoming the
    builtin name with a FutureWarning; an unknown builtin is refused at load with the names there are."""
    from pipeline import builtin
    from pipeline.tasks import load_callable

    with pytest.warns(FutureWarning, match="'pipeline.tasks:math_answer' is deprecated; name it 'builtin:math_answer'"):
        old = config_from_dict({"rewards": [{"fn": "pipeline.tasks:math_answer"}],
                                "generator": {"rollout": "generator.calculator:rollout"}})
    assert old.rewards[0].fn == "builtin:math_answer" and old.generator.rollout == "builtin:calculator"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the builtin names themselves warn of nothing
        assert config_from_dict({"rewards": [{"fn": "builtin:math_answer"}]}).rewards[0].fn == "builtin:math_answer"
    for name, path in builtin.FUNCTIONS.items():  # each name loads the very function of its old path
        module, _, attr = path.partition(":")
        assert load_callable(name, "x") is getattr(importlib.import_module(module), attr)
    with pytest.raises(ConfigError, match=r"rewards\[1\].fn: 'builtin:math' is not a builtin function; there are "
                                          r"builtin:echo_reward, .*builtin:math_answer"):
        config_from_dict({"rewards": [{"fn": "builtin:echo_reward"}, {"fn": "builtin:math"}]})
    with pytest.raises(ConfigError, match="generator.agent: 'builtin:nope' is not a builtin"):
        config_from_dict({"generator": {"rollout": "builtin:agent", "agent": "builtin:nope"}})


def test_sampling_seed_is_none_or_a_non_negative_integer():
    assert load_config(None, []).sampling.seed is None
    assert load_config(None, ["sampling.seed=7"]).sampling.seed == 7
    with pytest.raises(ConfigError, match=r"sampling.seed: must be >= 0"):
        load_config(None, ["sampling.seed=-1"])


def test_services_let_their_openmp_threads_sleep_unless_the_user_said_otherwise(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE before torch is imported: on a host whose learner, CPU engine and generator share the
    cores, a thread spinning at a barrier holds a core another process needs (a run took twice as long)."""
    monkeypatch.setattr(os, "environ", {})
    apply_environment(load_config(None, []))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setattr(os, "environ", {"OMP_WAIT_POLICY": "ACTIVE"})
    apply_environment(load_config(None, []))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
