"""`jaxinfer bench latency | throughput | serve | roofline` (vLLM-style benchmark output)."""
