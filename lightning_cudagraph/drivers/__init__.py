"""Capture-mode drivers: scoped regions (PyTorch or Transformer Engine) and the whole training step."""
