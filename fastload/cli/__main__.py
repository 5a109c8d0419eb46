"""``python -m fastload.cli``: the same command line as the ``fastload`` script."""

from fastload.cli import main

main()
