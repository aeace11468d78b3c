"""The input pipeline: image collections in, batches of features out (what dumps, metrics and the CLI share)."""
