"""The generator service: one vLLM engine, an asyncio loop, reward functions."""
