"""The shipped functions by their `builtin:` names, as `data.path` names the builtin tasks: a config says
`builtin:math_answer`, whatever module holds the function. The module paths they had before (`pipeline.tasks:
math_answer`) still load: the config takes the builtin name in their place and a FutureWarning says so."""

from __future__ import annotations

import warnings

FUNCTIONS = {  # name: the module:function it loads
    "builtin:echo_reward": "pipeline.tasks:echo_reward",          # rewards: builtin:echo's
    "builtin:reverse_reward": "pipeline.tasks:reverse_reward",    # rewards: builtin:reverse's
    "builtin:math_answer": "pipeline.tasks:math_answer",          # rewards: the number after '####', else the last
    "builtin:reasoning_gym_reward": "pipeline.tasks:reasoning_gym_reward",  # rewards: the dataset's score_answer
    "builtin:environment_reward": "generator.environment:get_reward",  # rewards: each environment's get_reward()
    "builtin:single_turn": "generator.rollout:single_turn",       # generator.rollout: one completion per sample
    "builtin:calculator": "generator.calculator:rollout",         # generator.rollout: one calculator call allowed
    "builtin:agent": "generator.agent:AgentRollout",              # generator.rollout: generator.agent's program
    "builtin:environment": "generator.environment:EnvironmentRollout",  # generator.rollout: a TRL environment class
    "builtin:calculator_agent": "generator.calculator_agent:agent",  # generator.agent: an openai-client agent
}
OLD = {path: name for name, path in FUNCTIONS.items()}
# generator.rollout's strategies that are classes, built with the run's config (generator/spec.py), not functions
STRATEGIES = ("builtin:agent", "builtin:environment")
# data.path's builtin tasks (pipeline/tasks.py BUILTIN makes their rows), named here for the config's check
DATASETS = ("builtin:echo", "builtin:reverse", "builtin:arith", "builtin:reasoning_gym")
REASONING_GYM_DEFAULT = "letter_counting"  # data.name of builtin:reasoning_gym when none is given


def canonical(spec: str, field: str) -> str:
    """The name a config keeps for `spec`: a shipped function's old module path becomes its builtin name (with a
    FutureWarning naming `field`); anything else is kept as given."""
    if spec in OLD:
        warnings.warn(f"{field}: {spec!r} is deprecated; name it {OLD[spec]!r} (the same function)", FutureWarning,
                      stacklevel=2)
        return OLD[spec]
    return spec


def module_path(spec: str) -> str:
    """The `module:function` to import for `spec`: a builtin's, or `spec` itself. An unknown builtin name raises
    ValueError with the names there are."""
    if not spec.startswith("builtin:"):
        return spec
    if spec not in FUNCTIONS:
        raise ValueError(f"{spec!r} is not a builtin function; there are {', '.join(FUNCTIONS)}")
    return FUNCTIONS[spec]
