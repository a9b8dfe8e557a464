"""An OpenEnv environment and the TRL environment_factory class that uses it, as TRL's OpenEnv docs write them
(docs/source/openenv.md: EchoToolEnv over OpenEnv's echo_env), for tests/integration/test_environment.py.

The server: an OpenEnv MCPEnvironment with one FastMCP tool, served by OpenEnv's create_app in a process of its own
(`python -m uvicorn tests.integration.openenv_calculator:app`), as OpenEnv runs its environments. Each session keeps
the sums it was asked for. The client side: `CalculatorToolEnv`, one instance per sample (generator.environment), whose
`add` method is the model's tool and calls the server through OpenEnv's MCPToolClient; its reward is whether a sum the
server worked out is the answer. Every instance writes what it did to the file CALCULATOR_LOG names."""

from __future__ import annotations

import json
import os
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core import MCPToolClient
from openenv.core.env_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class CalculatorEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calculator")
        self.sums: list[int] = []

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.sums.append(a + b)
            return a + b

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.sums = []
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=0.0, metadata={"status": "ready"})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


app = create_app(CalculatorEnvironment, CallToolAction, CallToolObservation, env_name="calculator",
                 max_concurrent_envs=64)


class CalculatorToolEnv:
    """TRL's environment_factory contract: reset, the tools as public methods, get_reward."""

    def __init__(self):
        self.client = None
        self.answer, self.asked, self.sums, self.calls = None, [], [], 0

    async def reset(self, answer: str = "", **kwargs) -> None:
        self.client = MCPToolClient(base_url=os.environ["CALCULATOR_URL"])
        await self.client.reset()
        self.answer, self.asked, self.sums, self.calls = int(answer.split("####")[-1]), [], [], 0

    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1  # a call the server refuses (a float where its schema says integer) raises: no sum
        result = await self.client.call_tool("add", a=a, b=b)
        self.asked.append([int(a), int(b)])  # as the server read them ("3" and 3.0 are 3 to its schema)
        self.sums.append(int(result.data if hasattr(result, "data") else result))
        return self.sums[-1]

    def get_reward(self) -> float:
        with open(os.environ["CALCULATOR_LOG"], "a") as f:
            f.write(json.dumps({"answer": self.answer, "calls": self.calls, "asked": self.asked,
                                "sums": self.sums}) + "\n")
        return float(self.answer in self.sums)
