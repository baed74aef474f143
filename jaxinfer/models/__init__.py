"""Model implementations, the architecture registry and the weight loader."""
