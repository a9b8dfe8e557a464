"""A process forked from a generator (vLLM's engine core: forked on a GPU, and on CPU for a generator's first engine,
generator/engine.py) has signals of its own: the SIGTERM that shuts an old engine down when the generator builds
another reached the generator's event loop through the wakeup fd fork handed down, and the generator drained and
left (tests/integration/test_one_truth.py builds an engine again)."""

import asyncio
import multiprocessing
import os
import signal
import time

import generator.engine  # noqa: F401  (what a generator imports before its engine: the at-fork hook)


def _wait_to_be_killed() -> None:
    time.sleep(60)


async def test_a_signal_to_a_forked_child_does_not_reach_the_parents_event_loop():
    loop = asyncio.get_running_loop()
    got: list[str] = []
    loop.add_signal_handler(signal.SIGUSR1, lambda: got.append("parent's handler"))
    child = multiprocessing.get_context("fork").Process(target=_wait_to_be_killed, daemon=True)
    child.start()
    try:
        await asyncio.sleep(0.5)  # the child is past its start
        os.kill(child.pid, signal.SIGUSR1)  # its inherited handler is a no-op; the parent's must not run
        await asyncio.sleep(1.0)
        assert child.is_alive() and got == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the parent's own still does
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.1)
        assert got == ["parent's handler"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
