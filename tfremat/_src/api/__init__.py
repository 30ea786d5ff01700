"""tfremat internals: the entry points that plan (`remat_sequential`,
`remat_model`, `remat_in_place_for_budget`, `largest_batch`), on top of
planning."""

__all__ = []
