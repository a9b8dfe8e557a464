"""The learner service: DeepSpeed engine, the hub, the GRPO loss, weight publishing, checkpoints."""
