"""The packing benchmark of the FGD paper (`dynpart bench packing`): pods arrive once and never
leave; the figure is the GPU allocation ratio. Imports the shared layer only, never `replay`."""
