"""A pod trace replayed over time on a MIG or MPS cluster (`dynpart simulate`), planned by
`plan()`. Imports the shared layer only, never `packing`."""
