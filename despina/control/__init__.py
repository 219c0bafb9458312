"""The control plane: the model registry, the catalog of what should serve, and its upkeep."""
