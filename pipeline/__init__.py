"""What learner and generators share: config, protocol, tasks, metrics, security; and the command line."""
