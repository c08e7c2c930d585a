"""``python -m jaxrl_term``: the list of entry points."""

from jaxrl_term.cli import listing

print(listing())
