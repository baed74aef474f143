"""Pallas kernels for jaxinfer, each with a pure-jnp reference in reference.py."""
