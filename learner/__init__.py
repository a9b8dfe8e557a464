"""The learner service: the DeepSpeed engine, the GRPO loss, weight publishing, checkpoints.

Rank 0 also starts the hub (hub/), which runs on a thread of its own; the training loop takes its batches and ends
its steps through `Hub`'s methods."""
