"""`python -m leapdecode` is the `leapdecode` command."""

from leapdecode.cli import main

main()
