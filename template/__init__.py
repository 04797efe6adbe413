"""A PyTorch Lightning training template that keeps the GPU busy."""
