"""Graph mechanics: scoped regions (``local``), whole steps (``full``), Transformer Engine (``te``), their owner."""
