"""Core CLI subcommands, one module each (``add_parser(subparsers)``)."""
