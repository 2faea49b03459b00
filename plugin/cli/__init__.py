"""The commands of ``python -m plugin``, one module each (``register(subparsers)``, ``run(args) -> int``)."""
