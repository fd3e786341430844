"""The benchmark harness: models and variants, timing in alternated rounds, figures, JSON records."""
