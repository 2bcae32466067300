"""The ``rocketstore`` command line: one module a group of subcommands, over the library."""
