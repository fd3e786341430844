"""Examples: a small GPT and an MoE GPT trained through LightningCLI with CUDA graphs."""
