"""``python -m reef_stream.cli`` is ``reef`` (torchrun and the tests start it this way)."""

from reef_stream.cli.main import main

main()
