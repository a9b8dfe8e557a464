"""An example agent (`generator.rollout: builtin:agent`, configs/gpu-smollm2-agent.yaml): an ordinary `openai` program
with a calculator tool, for builtin:arith. The model answers; the calculator works out every "a + b" or "a - b" the
answer wrote and says what each comes to; the model then gives its final answer, which the reward functions score. Two
calls a sample, the calculator's reply between them (out of the loss: generator/agent.py)."""

import re

EXPRESSION = re.compile(r"(\d+)\s*([+-])\s*(\d+)")


async def agent(client, item) -> str:
    messages = list(item.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=128)
    text = first.choices[0].message.content
    found = EXPRESSION.findall(text)[:4]
    if not found:
        return text
    worked = "; ".join(f"{a} {op} {b} = {int(a) + int(b) if op == '+' else int(a) - int(b)}" for a, op, b in found)
    messages += [{"role": "assistant", "content": text},
                 {"role": "user", "content": f"Calculator: {worked}. Give your final answer as #### N."}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return second.choices[0].message.content
