"""Agents for tests/integration/test_agent.py: ordinary `openai` programs, as a user writes them."""

import os


async def calculator(client, item):
    """Ask, get a calculator's reply as the next user message, ask again, then a third time: three calls. The first
    agent to start after AGENT_FAIL_ONCE names a file that does not exist yet fails after its first call (a tool that
    raised)."""
    messages = list(item.messages)
    answer = item.columns["answer"].split("####")[-1].strip()
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if turn == 0 and _first(os.environ.get("AGENT_FAIL_ONCE")):
            raise ConnectionError("the calculator is down")
        if turn < 2:
            messages.append({"role": "user", "content": f"Calculator: {answer}. Say the number."})
    return messages[-1]["content"]


def _first(path: str | None) -> bool:
    """True for the one caller that creates `path`."""
    if not path:
        return False
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
