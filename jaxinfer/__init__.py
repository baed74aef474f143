"""jaxinfer: a JAX/Pallas reimplementation of the vLLM V1 inference engine."""

__version__ = "0.1.0"
