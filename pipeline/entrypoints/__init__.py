"""The `pipeline` command, one file per subcommand: cli.py parses and hands over; run.py (learner and generators on
this machine), learner.py, generator.py, remote.py (`status`, `set`) and keys.py each add their arguments and hold
their `main`. service.py is what the three services share: their arguments, and the config loaded, checked and
applied before anything heavy is imported.

This is the top of the import order (tests/unit/test_layering.py): an entry point may import the learner, the hub,
the generator and the weights; nothing imports an entry point.
"""
