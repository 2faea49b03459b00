"""The CLI's commands: one module per command, each with ``register(subparsers)`` and ``run(args) -> int``."""
