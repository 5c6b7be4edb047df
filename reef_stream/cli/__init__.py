"""The ``reef`` command line: one click group (``main``), one error-to-exit-status mapping and
one signal handler (``common``), and a module per command. Entry point:
``reef_stream.cli.main:main``."""
