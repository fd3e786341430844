"""Each kind of graph: scoped regions, the whole step, the optimizer update, the evaluation step and regions."""
