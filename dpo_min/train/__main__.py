"""`python -m dpo_min.train`."""

from . import cli

cli()
