"""Layers shared by every model: norms, rotary, linear, MLP, attention dispatch."""
