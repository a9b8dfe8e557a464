"""What a generator serves: the run's config, taken from the hub before each registration (pipeline/runspec.py), and the
engine built for it (generator/engines.py). The generator (generator/service.py) holds one `Spec` and asks it to
`adopt` before it registers; the session's requests go through the `ask` it passes (its `_ask`: an Error with `stop`
raises its Refused).

    SpecRequest(claims)                 -> RunSpec, or refused: a claim of the generator's own config differs
    adopt: the run's values, its own for where and how it runs; the content of the code and files they name
    digested on this host (pipeline/pinning.py) and compared with the learner's (RunSpec.contents): another
    source under the same name is told to the hub (SpecRequest(problem)), which refuses it; else the rewards and
    rollout function imported
    where the engine it has cannot serve them (`engines.rebuild`):
        SpecRequest(claims, fingerprints) -> refused: its model files are not the learner's
        build the engine                   (a problem on the way is told to the hub: SpecRequest(problem))
A generator started before its learner, whose own config names the model, builds that engine while the hub does not
answer yet (`prebuild`; before it asks, with `pipeline generator --build-first`); the spec keeps it or replaces it,
and Register's fingerprints and content digests are checked by the hub.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from generator.engine import adapter_slots
from generator.engines import rebuild
from generator.rollout import FunctionRollout, Rollout
from pipeline import builtin, pinning, runspec
from pipeline import protocol as P
from pipeline.config import Config
from pipeline.tasks import load_callable, load_reward_fns

log = logging.getLogger(__name__)

EARLY_S = 5.0  # seconds: no answer from the hub this long, and its own config names a model: build that meanwhile


def load_rollout(cfg: Config) -> Rollout:
    """generator.rollout's strategy: a class built with `cfg` (builtin:agent, generator/agent.py, with its endpoint;
    builtin:environment, generator/environment.py), else the function it names."""
    made = load_callable(cfg.generator.rollout, "generator.rollout")
    return made(cfg) if cfg.generator.rollout in builtin.STRATEGIES else FunctionRollout(made)


class CannotServe(Exception):
    """This generator cannot serve the run: the hub was told why (and refuses it)."""


class Spec:
    def __init__(self, own: Config, engines, explicit: frozenset | set, gen_id: str):
        """`own`: the generator's own config; `explicit`: the dotted keys it set (what it claims); `engines`:
        generator.engines.VllmEngines, or Fixed (an engine built elsewhere, which serves `own` as given until a run's
        spec comes)."""
        self.own, self.engines, self.explicit, self.id = own, engines, explicit, gen_id
        self.claims = runspec.claims(own, explicit)
        self.cfg = own  # the run's, once adopted
        self.engine, self.tok = engines.current()
        self.built = copy.deepcopy(own) if self.engine is not None else None  # the config its engine was built for
        self.fingerprints: dict[str, str] = {}
        self.contents: dict[str, str] = {}  # of the code and files the adopted config names, on this host
        self.digest = ""
        self.rewards = load_reward_fns(own.rewards) if self.engine is not None else []
        self.rollout: Rollout | None = load_rollout(own) if self.engine is not None else None

    @property
    def adapter_slots(self) -> int:
        assert self.built is not None, "no engine built yet"
        return adapter_slots(self.built)

    async def close(self) -> None:
        """Stop what the rollout strategy runs (an agent's endpoint)."""
        if self.rollout is not None:
            await self.rollout.aclose()

    async def adopt(self, ask) -> str:
        """Take the run's config for what this generator serves, and build the engine for it where the one it has
        cannot serve it. Returns why the hub did not give the spec ("" when it did; a refusal for good raises)."""
        early = self.engine is None and "model.path" in self.explicit
        try:
            spec = await ask(P.SpecRequest(self.id, self.claims), timeout=EARLY_S if early else 10.0)
        except P.PeerLost:
            if early:  # no hub yet (a learner still starting): its own model meanwhile, as its engine's start is long
                await self.prebuild("the hub does not answer yet: from its own config meanwhile")
            raise
        if not isinstance(spec, P.RunSpec):
            return str(getattr(spec, "message", spec))
        try:
            cfg = runspec.adopt(self.own, spec.config, self.explicit)
            if changed := runspec.overridden(self.claims, cfg):  # the learner's anyway (they travel with leases)
                log.warning("generator %s: the run's values replace its own config's: %s", self.id,
                            "; ".join(changed))
            contents = pinning.content_digests(cfg)
        except Exception as e:  # a module or file the run names is not on this host
            await self._cannot_serve(ask, f"{type(e).__name__}: {e}")
        # before the functions are imported: another module under the run's name does not run here
        if why := pinning.content_conflict(contents, spec.contents, cfg):
            await self._cannot_serve(ask, why)
        try:
            rewards = load_reward_fns(cfg.rewards)
            rollout = load_rollout(cfg)
        except Exception as e:  # the run's reward or rollout functions cannot be imported here
            await self._cannot_serve(ask, f"{type(e).__name__}: {e}")
        if why := rebuild(self.built, cfg):
            await self._build(cfg, why, ask)
        await self.close()  # the strategy replaced (an agent's endpoint stops)
        self.cfg, self.rewards, self.rollout, self.digest = cfg, rewards, rollout, runspec.digest(cfg)
        self.contents = contents
        return ""

    def follow_staleness(self, k: int) -> str:
        """`pipeline set trainer.max_staleness` (k < 0: none said): why the engine must be built again ("" when its
        adapter slots hold a version per lag)."""
        if k < 0 or k == self.cfg.trainer.max_staleness:
            return ""
        self.cfg.trainer.max_staleness = k
        return rebuild(self.built, self.cfg) if self.built is not None else ""

    async def prebuild(self, why: str) -> None:
        """The engine its own config names, built before the hub answers; the run's spec, once the hub answers, keeps
        it or builds another (`rebuild`); its Register shows the fingerprints, which the hub checks."""
        try:
            await self._build(self.own, why)
        except Exception as e:  # said to the hub once it answers, on the usual path
            log.warning("generator %s: no engine from its own config (%s: %s)", self.id, type(e).__name__, e)

    async def _build(self, cfg: Config, why: str, ask=None) -> None:
        """The engine for `cfg`; with `ask`, the hub first compares its files' fingerprints with the learner's, and a
        problem on the way is told to it (without: raised)."""
        try:
            fingerprints = await asyncio.to_thread(self.engines.fingerprints, cfg)
        except Exception as e:  # no such model directory or tokenizer on this host
            if ask is None:
                raise
            await self._cannot_serve(ask, f"model.path: {e}")
        if ask is not None:  # another model is refused before an engine is built for it
            await ask(P.SpecRequest(self.id, self.claims, fingerprints), timeout=10.0)
        log.info("generator %s: building its engine for model.path %s (%s)", self.id, cfg.model.path, why)
        self.built = None
        try:
            self.engine, self.tok = await self.engines.build(cfg)
        except Exception as e:
            log.exception("generator %s: the engine did not start", self.id)
            if ask is None:
                raise
            await self._cannot_serve(ask, f"the engine did not start for model.path {cfg.model.path} "
                                          f"({type(e).__name__}: {e})")
        self.built, self.fingerprints = copy.deepcopy(cfg), fingerprints

    async def _cannot_serve(self, ask, problem: str) -> None:
        """Tell the hub why this generator cannot serve the run: it refuses it (counted); raises."""
        reply = await ask(P.SpecRequest(self.id, self.claims, problem=problem[:16000]), timeout=10.0)
        raise CannotServe(f"it cannot serve the run: {problem} ({getattr(reply, 'message', reply)})")
