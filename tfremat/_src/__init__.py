"""tfremat's internals: the rematerialization core and what builds on it.

Nothing here is a stable API: use the names `tfremat`, `tfremat.policies`,
`tfremat.measure`, `tfremat.planner`, `tfremat.chain`, `tfremat.errors` and
`tfremat.lingvo` export. CONTRIBUTING.md shows how the modules depend on
each other.
"""

__all__ = []
