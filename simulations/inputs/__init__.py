"""The simulator's shared input layer: pod traces, cluster specs, the synthetic workload and the
command-line inputs of `dynpart simulate` and `dynpart bench packing`."""
