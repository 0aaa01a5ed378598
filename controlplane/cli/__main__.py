"""`python -m controlplane.cli`: how `sluice run` starts its controller."""

from controlplane.cli.main import main

main()
