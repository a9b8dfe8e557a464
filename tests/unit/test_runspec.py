"""One run, one truth, without engines: what a generator adopts and claims (pipeline/runspec.py), what the hub refuses
(SpecRequest, Register), what a resume may change, and more learner ranks than GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline import protocol as P
from pipeline import runspec
from pipeline.config import config_from_dict, load_config
from pipeline.runtime_knobs import apply_runtime_change
from tests.conftest import REPO
from tests.unit.peers import Peer, new_hub


def _own(data: dict, overrides=()) -> tuple:
    return config_from_dict(data, list(overrides)), runspec.explicit_keys(data, list(overrides))


def test_a_generator_adopts_what_the_run_serves_and_keeps_where_and_how_it_runs():
    run = config_from_dict({"model": {"lora": {"r": 8, "alpha": 16}, "quantization": "4bit"},
                            "rewards": [{"fn": "builtin:reverse_reward"}], "sampling": {"max_tokens": 12},
                            "trainer": {"group_size": 4, "batch_size": 48, "lr": 1e-4},
                            "generator": {"lora_mode": "adapter"}})
    own, explicit = _own({"generator": {"max_num_seqs": 7, "gpu_memory_utilization": 0.3}}, ["model.path=/mnt/x"])
    assert runspec.claims(own, explicit) == {}  # host fields, and the path (claimed by fingerprint)
    served = runspec.adopt(own, runspec.spec_of(run), explicit)
    assert served.model.quantization == "4bit" and served.model.lora.alpha == 16 and served.model.path == "/mnt/x"
    assert served.rewards[0].fn == "builtin:reverse_reward" and served.trainer.group_size == 4
    assert served.trainer.batch_size == 48  # what its first wave is sized from (generator/leases.py)
    assert served.sampling.max_tokens == 12 and served.generator.lora_mode == "adapter"
    assert (served.generator.max_num_seqs, served.generator.gpu_memory_utilization) == (7, 0.3)
    assert served.trainer.lr != run.trainer.lr  # the learner's own business, not served
    assert runspec.digest(served) == runspec.digest(run)
    # run-time knobs travel with leases and heartbeats: changing them leaves the digest as it was
    digest = runspec.digest(run)
    for key, value in (("trainer.max_staleness", 6), ("sampling.temperature", 0.7), ("generator.lease_size", 2)):
        apply_runtime_change(run, key, value)
    assert runspec.digest(run) == digest
    run.sampling.max_tokens = 13
    assert runspec.digest(run) != digest


@pytest.mark.parametrize("overrides, field", [
    (["model.lora={r: 8}", "model.quantization=8bit"], "model.quantization"),
    (["model.quantization=null"], "model.quantization"),
    (["rewards=[{fn: builtin:echo_reward}]"], "rewards"),
    (["model.lora={r: 16}"], "model.lora.r"),
    (["generator.rollout=builtin:calculator"], "generator.rollout"),
    (["generator.max_model_len=128"], "generator.max_model_len"),
])
def test_what_a_generators_own_config_says_otherwise_is_refused_naming_the_field(tmp_path, overrides, field):
    hub = new_hub(tmp_path, model={"lora": {"r": 8}, "quantization": "4bit"},
                  rewards=[{"fn": "builtin:reverse_reward"}], sampling={"max_tokens": 12})
    peer = Peer(hub, "gen-a")
    try:
        own, explicit = _own({}, overrides)
        reply = peer.ask(P.SpecRequest("gen-a", runspec.claims(own, explicit)))
        assert isinstance(reply, P.Error) and reply.stop and field in reply.message, reply
        assert hub.counters["refused_spec"] == 1 and not hub.registry.generators
        # the same values as the run's are no conflict: a generator given the learner's config file; what travels with
        # every lease anyway (sampling, the group size) is the run's, said in a warning
        same, explicit = _own({}, ["model.lora={r: 8}", "model.quantization=4bit", "sampling.max_tokens=9",
                                   "rewards=[{fn: builtin:reverse_reward}]", "trainer.lr=0.5",
                                   "trainer.group_size=8", "generator.max_num_seqs=3"])
        claims = runspec.claims(same, explicit)
        assert isinstance(peer.ask(P.SpecRequest("gen-a", claims)), P.RunSpec)
        assert runspec.overridden(claims, hub.cfg) == ["sampling.max_tokens: 9 -> 12", "trainer.group_size: 8 -> 2"]
    finally:
        peer.close()
        hub.stop()


def test_a_register_must_show_the_runs_spec_and_model_files(tmp_path):
    prints = {"model.path": "a" * 32, "model.tokenizer": "b" * 32}
    hub = new_hub(tmp_path)
    hub.membership.fingerprints = prints
    peer = Peer(hub, "gen-b")
    try:
        spec = peer.ask(P.SpecRequest("gen-b"))
        assert isinstance(spec, P.RunSpec) and spec.fingerprints == prints and spec.digest == hub.membership.spec_digest
        other = {**prints, "model.path": "c" * 32}
        reply = peer.ask(P.SpecRequest("gen-b", {}, other))
        assert isinstance(reply, P.Error) and reply.stop and "model.path" in reply.message
        for fields, why in (({"fingerprints": prints}, "another config"),  # a generator that never asked for the spec
                            ({"spec_digest": spec.digest, "fingerprints": other}, "model.path"),
                            ({"spec_digest": spec.digest}, "model.path")):
            reply = peer.ask(P.Register("gen-b", **fields))
            assert isinstance(reply, P.Error) and reply.stop and why in reply.message, (fields, reply)
        assert hub.counters["refused_spec"] == 4 and not hub.registry.generators
        reply = peer.ask(P.SpecRequest("gen-b", problem="model.path: /m: no such directory on this host"))
        assert isinstance(reply, P.Error) and "/m: no such directory" in reply.message
        welcome = peer.register(spec_digest=spec.digest, fingerprints=prints, adapter_slots=3)
        assert isinstance(welcome, P.Welcome) and hub.registry.generators["gen-b"].adapter_slots == 3
        assert [e["event"] for e in _events(tmp_path)].count("spec_refused") == 5
        # a run-time k reaches the generators with their heartbeats (adapter slots follow it)
        assert peer.ask(P.Heartbeat("gen-b", 0)).max_staleness == hub.cfg.trainer.max_staleness
        assert isinstance(peer.ask(P.SetRequest("trainer.max_staleness", 6)), P.SetReply)
        assert peer.ask(P.Heartbeat("gen-b", 0)).max_staleness == 6
    finally:
        peer.close()
        hub.stop()


def _events(run_dir) -> list[dict]:
    from pipeline.metrics import read_jsonl

    return read_jsonl(run_dir / "events.jsonl")


def test_a_resume_may_change_only_how_the_run_goes_on():
    saved = load_config(REPO / "configs" / "demo.yaml", ["model.lora={r: 8, alpha: 16}"])
    same = load_config(REPO / "configs" / "demo.yaml", [
        "model.lora={r: 8, alpha: 16}", "trainer.total_steps=500", "trainer.lr=1e-4", "trainer.max_staleness=4",
        "hub.port=6000", "run.generators=3", "generator.gpu_memory_utilization=0.8", "trainer.micro_batch_tokens=0",
        "trainer.checkpoint_every=5", "eval.every=10", "trainer.gpu_memory_gb=40"])
    assert runspec.resume_conflict(same, saved, "RUN/config.yaml") == ""
    for override, field in (("model.lora.alpha=64", "model.lora.alpha"), ("model.lora.use_rslora=true",
                                                                          "model.lora.use_rslora"),
                            ("model.lora.target_modules=[q_proj]", "model.lora.target_modules"),
                            ("model.lora=null", "model.lora"), ("model.dtype=bfloat16", "model.dtype"),
                            ("trainer.loss=tis", "trainer.loss"), ("trainer.batch_size=4", "trainer.batch_size"),
                            ("data.seed=3", "data.seed"), ("trainer.zero_stage=3", "trainer.zero_stage")):
        cfg = load_config(REPO / "configs" / "demo.yaml", ["model.lora={r: 8, alpha: 16}", override])
        why = runspec.resume_conflict(cfg, saved, "RUN/config.yaml")
        assert why.startswith(f"{field} is ") and "RUN/config.yaml" in why, why


def test_more_learner_ranks_than_gpus_given_is_refused_at_start_with_both_numbers(tmp_path):
    for args in (["learner", "-c", "configs/demo.yaml", "--run-dir", str(tmp_path / "r"), "--gpus", "0",
                  "--set", "trainer.ranks=2"],
                 ["run", "--run-dir", str(tmp_path / "r"), "--set", "run.learner_gpus='0,1'", "--set",
                  "trainer.ranks=3"]):
        out = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
        ranks, gpus = args[-1][-1], str(len(args[args.index("--gpus") + 1].split(","))) if "--gpus" in args else "2"
        assert out.returncode == 2 and f"trainer.ranks: {ranks} learner ranks" in out.stderr, out.stderr
        assert f"gives {gpus} GPU" in out.stderr
    assert not (tmp_path / "r").exists()


def test_a_fingerprint_is_of_the_files_not_of_their_path(tmp_path, model_cache):
    import json
    import shutil

    from pipeline.fingerprint import fingerprints
    from pipeline.tinymodel import resolve_model_path

    tiny = resolve_model_path("builtin:tiny")
    copy = shutil.copytree(tiny, tmp_path / "elsewhere")
    want = fingerprints(tiny)
    assert fingerprints(copy) == want and set(want) == {"model.path", "model.tokenizer"}
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0"}, indent=4))
    assert fingerprints(copy) == want  # what a save stamps, and the layout of the JSON, are not the model
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one bit of the last weight
    (copy / "model.safetensors").write_bytes(bytes(weights))
    changed = fingerprints(copy)
    assert changed["model.path"] != want["model.path"] and changed["model.tokenizer"] == want["model.tokenizer"]
    (copy / "tokenizer_config.json").write_text(json.dumps({**json.loads((copy / "tokenizer_config.json")
                                                                        .read_text()), "chat_template": "{{ x }}"}))
    assert fingerprints(copy)["model.tokenizer"] != want["model.tokenizer"]


class CountingEngines:
    """A generator's engines without vLLM: a fake engine per build, each build's config kept."""

    def __init__(self):
        self.engine = self.tok = None
        self.built = []

    def current(self):
        return self.engine, self.tok

    def fingerprints(self, cfg) -> dict:
        return {}

    async def build(self, cfg):
        from tests.unit.test_generator_loop import FakeEngine, FakeTokenizer

        self.built.append(cfg)
        self.engine, self.tok = FakeEngine(), FakeTokenizer()
        return self.engine, self.tok

    def close(self) -> None:
        pass


@pytest.mark.parametrize("run_len, builds", [(256, 1), (128, 2)])
async def test_a_generator_started_before_its_learner_builds_its_own_model_meanwhile(tmp_path, free_port, run_len,
                                                                                     builds):
    """No hub yet: an engine of the model its own config names, meanwhile (an engine's start is long); once the hub
    answers, the run's spec keeps it, or builds another where the run's engine settings differ (max_model_len)."""
    import asyncio

    from generator.service import Generator
    from tests.unit.test_generator_loop import _until

    own, explicit = _own({"model": {"path": "builtin:tiny"}, "hub": {"heartbeat_s": 0.2}})
    engines = CountingEngines()
    gen = Generator(own, engines, f"tcp://127.0.0.1:{free_port}", explicit=explicit)
    task = asyncio.create_task(gen.run(handle_signals=False))
    hub = None
    try:
        await _until(lambda: len(engines.built) == 1, 30)  # before any hub answered
        hub = new_hub(tmp_path, hub={"port": free_port}, generator={"max_model_len": run_len})
        await _until(lambda: gen.id in hub.registry.generators, 60)
        assert len(engines.built) == builds and engines.built[-1].generator.max_model_len == run_len
    finally:
        gen.stopping = 2
        gen.leave_now.set()  # as a second signal: whatever it waits for (weights never published here) ends
        await asyncio.wait_for(task, 30)
        if hub is not None:
            hub.stop()


async def test_an_engine_built_first_is_the_one_the_run_keeps(tmp_path, free_port):
    """`pipeline generator --build-first` (`pipeline run`'s generators that are not held): the engine its own config
    names is built before it asks the hub anything; the run's spec, the same config, keeps it: one build."""
    import asyncio

    from generator.service import Generator
    from tests.unit.test_generator_loop import _until

    own, explicit = _own({"model": {"path": "builtin:tiny"}, "hub": {"heartbeat_s": 0.2}})
    engines = CountingEngines()
    gen = Generator(own, engines, f"tcp://127.0.0.1:{free_port}", explicit=explicit)
    hub = new_hub(tmp_path, hub={"port": free_port})
    task = None
    try:
        await gen.spec.prebuild("built first")
        assert len(engines.built) == 1 and gen.spec.built is not None and not hub.registry.generators
        task = asyncio.create_task(gen.run(handle_signals=False))
        await _until(lambda: gen.id in hub.registry.generators, 60)
        assert len(engines.built) == 1
    finally:
        gen.stopping = 2
        gen.leave_now.set()
        if task is not None:
            await asyncio.wait_for(task, 30)
        hub.stop()


# ---- content, not names: the code and files a config names (pipeline/pinning.py) ----------------------------------

SCORES = {"a": "[1.0, 0.0]", "b": "[1.0, 1.0]"}  # the finding's two hosts: one reward name, two scores


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Hosts as directories, each with its own `my_rewards.py` (same module and function name, other source:
    SCORES), and `use(name)`, which makes this process that host: its directory first on sys.path, the module
    imported before forgotten, the import system's caches invalidated."""
    import importlib

    base = list(sys.path)
    for name, scores in {**SCORES, "a-copy": SCORES["a"]}.items():
        (tmp_path / "hosts" / name).mkdir(parents=True)
        (tmp_path / "hosts" / name / "my_rewards.py").write_text(f"def score(completions, **_):\n    return {scores}\n")

    def use(name: str) -> None:
        monkeypatch.setattr(sys, "path", [str(tmp_path / "hosts" / name), *base])
        sys.modules.pop("my_rewards", None)
        importlib.invalidate_caches()

    yield use
    sys.modules.pop("my_rewards", None)


def _ask_with(peer: Peer):
    async def ask(msg, timeout: float = 10.0):
        return peer.ask(msg, timeout)
    return ask


def test_two_hosts_with_other_reward_source_under_one_name_differ_in_content_and_the_hub_refuses(tmp_path, hosts):
    """Issue 51, item 2: my_rewards:score on two hosts, same name, other source, scoring [1.0, 0.0] against
    [1.0, 1.0]: the run's digest (names) is the same, the content digest is not, and the hub refuses a Register
    showing the other host's, naming the field; the same file on a third host is no conflict."""
    from pipeline.pinning import content_conflict, content_digests
    from pipeline.tasks import load_callable

    cfg = config_from_dict({"rewards": [{"fn": "my_rewards:score"}]})
    seen = {}
    for host in ("a", "b", "a-copy"):
        hosts(host)
        seen[host] = content_digests(cfg)
        assert str(load_callable("my_rewards:score", "rewards[0].fn")(completions=["x", "y"])) == SCORES[host[0]]
    assert seen["a"]["rewards[0].fn"] != seen["b"]["rewards[0].fn"] and seen["a"] == seen["a-copy"]
    assert {k for k in seen["a"] if seen["a"][k] != seen["b"][k]} == {"rewards[0].fn"}
    why = content_conflict(seen["b"], seen["a"], cfg)
    assert why.startswith("rewards[0].fn (my_rewards:score): the source of module my_rewards differs") and \
        "deploy the same file on both hosts" in why, why
    assert content_conflict(seen["a-copy"], seen["a"], cfg) == ""
    hub = new_hub(tmp_path, rewards=[{"fn": "my_rewards:score"}])
    hub.membership.contents = seen["a"]  # the learner's host
    peer = Peer(hub, "gen-b")
    try:
        spec = peer.ask(P.SpecRequest("gen-b"))
        assert isinstance(spec, P.RunSpec) and spec.contents == seen["a"]
        reply = peer.register(spec_digest=spec.digest, contents=seen["b"])
        assert isinstance(reply, P.Error) and reply.stop and "rewards[0].fn (my_rewards:score)" in reply.message
        assert peer.register(spec_digest=spec.digest, contents={}).stop  # one that shows none
        assert hub.counters["refused_spec"] == 2 and not hub.registry.generators
        assert isinstance(peer.register(spec_digest=spec.digest, contents=seen["a-copy"]), P.Welcome)
    finally:
        peer.close()
        hub.stop()


async def test_a_generator_refuses_a_run_whose_reward_source_differs_on_its_host(tmp_path, hosts):
    """The generator's own check: it adopts the spec, digests the run's reward module on its host and tells the hub
    it cannot serve the run (refused, counted) before it imports it; with the same file it adopts the run."""
    from generator.spec import CannotServe, Spec
    from pipeline.pinning import content_digests

    hosts("a")
    hub = new_hub(tmp_path, rewards=[{"fn": "my_rewards:score"}])
    hub.membership.contents = content_digests(hub.cfg)
    peer = Peer(hub, "gen-b")
    try:
        hosts("b")
        own = config_from_dict({})
        with pytest.raises(CannotServe, match=r"rewards\[0\]\.fn \(my_rewards:score\): the source of module"):
            await Spec(own, CountingEngines(), set(), "gen-b").adopt(_ask_with(peer))
        assert hub.counters["refused_spec"] == 1 and "my_rewards" not in sys.modules  # refused before the import
        hosts("a-copy")
        spec = Spec(own, CountingEngines(), set(), "gen-b")
        assert await spec.adopt(_ask_with(peer)) == "" and spec.contents == hub.membership.contents
        assert isinstance(peer.register(spec_digest=spec.digest, contents=spec.contents), P.Welcome)
    finally:
        peer.close()
        hub.stop()


def test_a_chat_template_is_pinned_by_its_bytes(tmp_path):
    """generator.chat_template at one path, other bytes on another host: refused naming the field; the same bytes
    at another path agree (the path itself is in the run's digest, as the config gives it)."""
    from pipeline.pinning import content_conflict, content_digests

    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = config_from_dict({"generator": {"chat_template": str(template)}})
    learner = content_digests(cfg)
    assert content_digests(cfg) == learner and "generator.chat_template" in learner
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}")
    generator = content_digests(cfg)
    assert generator["generator.chat_template"] != learner["generator.chat_template"]
    why = content_conflict(generator, learner, cfg)
    assert why.startswith(f"generator.chat_template ({template}): the file {template} differs"), why
    hub = new_hub(tmp_path, generator={"chat_template": str(template)})
    hub.membership.contents = learner
    peer = Peer(hub, "gen-t")
    try:
        reply = peer.register(contents=generator)
        assert isinstance(reply, P.Error) and reply.stop and "generator.chat_template" in reply.message
    finally:
        peer.close()
        hub.stop()


def test_builtins_and_an_agent_commands_script_are_pinned_by_their_source(tmp_path, monkeypatch):
    """`builtin:` names: the source of the project's module that defines them, so a checkout whose builtin
    functions were edited differs even at the same version; a command: the script it names, not the interpreter."""
    import hashlib

    from pipeline.pinning import content_digests

    def sha(path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32]

    cfg = config_from_dict({"rewards": [{"fn": "builtin:math_answer"}], "generator": {"rollout": "builtin:calculator"}})
    got = content_digests(cfg)
    assert got == {"rewards[0].fn": sha(REPO / "pipeline" / "tasks.py"),
                   "generator.rollout": sha(REPO / "generator" / "calculator.py")}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text("print('4')\n")
    cfg = config_from_dict({"generator": {"rollout": "builtin:agent",
                                          "agent_command": ["python", "my_agent.py", "-v"]}})
    got = content_digests(cfg)
    assert got["generator.agent_command[1]"] == sha(tmp_path / "my_agent.py")
    assert got["generator.rollout"] == sha(REPO / "generator" / "agent.py")
    assert set(got) == {"rewards[0].fn", "generator.rollout", "generator.agent_command[1]"}  # not python, not -v


def test_a_reward_module_the_learners_host_lacks_is_refused_naming_the_field(tmp_path, monkeypatch):
    from pipeline.config import ConfigError
    from pipeline.pinning import content_digests

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.fn: no module 'no_such_rewards'"):
        content_digests(config_from_dict({"rewards": [{"fn": "builtin:echo_reward"}, {"fn": "no_such_rewards:f"}]}))


def test_a_resume_whose_reward_source_changed_is_refused(tmp_path, hosts):
    """A checkpoint records the content digests that trained it; a resume with another source under the reward's name
    is refused naming the field (rewards are not RESUMABLE); one written before they were recorded is not held."""
    import json

    from learner.checkpoint import CheckpointError, check_resume, meaning
    from pipeline.pinning import content_digests

    cfg = config_from_dict({"rewards": [{"fn": "my_rewards:score"}]})
    hosts("a")
    (tmp_path / "checkpoints" / "v2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("v2")
    weights = tmp_path / "checkpoints" / "v2" / "weights.json"
    weights.write_text(json.dumps({k: v for k, v in meaning(cfg, "", "full", content_digests(cfg)).items()
                                   if k != "model.path"}))
    assert check_resume(cfg, tmp_path) == []
    hosts("b")
    with pytest.raises(CheckpointError, match=r"rewards\[0\]\.fn \(my_rewards:score\): the source of module my_rewards "
                                              r"differs between this host .* and checkpoint v2"):
        check_resume(cfg, tmp_path)
    weights.write_text(json.dumps({"kind": "full"}))
    assert check_resume(cfg, tmp_path) == []
