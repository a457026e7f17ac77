"""Formats other tools read and write: speculators checkpoints (vLLM loads them), z-lab DFlash."""
