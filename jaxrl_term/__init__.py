"""jaxrl_term: RL for LLM terminal agents in JAX."""

from jaxrl_term.utils.hugepages import at_entry as _at_entry

_at_entry()  # entry points re-execute once with huge pages for malloc (jaxrl_term/utils/hugepages.py)
