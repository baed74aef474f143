"""Multi-host (multi-controller JAX): every process runs the same engine code over one global
mesh; the host scheduler runs on process 0, which broadcasts each step's inputs to the others.

    import jaxinfer.distributed, jax
    jaxinfer.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=RANK)
    llm = LLM(model, tensor_parallel_size=jax.device_count())  # workers block here
    if jax.process_index() == 0:
        outs = llm.generate(prompts)
        llm.shutdown()                                           # releases the workers
"""

from __future__ import annotations

import jax

_initialized = False


def is_initialized() -> bool:
    """This process joined a multi-process JAX run through initialize()."""
    return _initialized


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_ids=None) -> None:
    """jax.distributed.initialize, with gloo collectives when the devices are CPUs."""
    if jax.config.jax_platforms in (None, "", "cpu") or jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
    global _initialized
    _initialized = True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_driver() -> bool:
    """Process 0 runs the scheduler and the API; the others only execute steps."""
    return jax.process_index() == 0
