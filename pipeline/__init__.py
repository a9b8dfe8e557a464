"""What learner and generators share: config, protocol, transports, tasks, metrics, CLI."""
