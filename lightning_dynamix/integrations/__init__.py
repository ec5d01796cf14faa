"""lightning-dynamix outside Lightning: the same per-rank batches and exact gradients under other launchers."""
