"""The hub: the run's message queue, a thread of the learner's rank 0 (hub/hub.py says which part handles each message).

It registers generators, leases prompts, checks and buffers rollouts, announces weight versions and answers
operators. It imports no torch (tests/unit/test_layering.py holds it to that): the trainer (learner/) drives it
through `Hub`'s methods; hub/serving.py holds the weight transports' senders (weights/) for it.
"""
