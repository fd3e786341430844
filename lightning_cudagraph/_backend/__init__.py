"""The backend seam: capturing and replaying graphs (CUDA, the local implementation, Transformer Engine), compiling."""
