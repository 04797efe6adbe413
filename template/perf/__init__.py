"""Mechanisms for measuring and improving the host/device relationship.

Nothing in this package imports Lightning: each piece works with plain PyTorch and is
tested alone; ``template.callbacks`` adapts them to the Trainer.
"""
