"""Graph mechanics: the capture backend seam, the CUDA backend, scoped regions (PyTorch, Transformer Engine)."""
