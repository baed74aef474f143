"""`--data-parallel-backend ray`: every data-parallel rank is a Ray actor running an engine core.

Ray is the cluster manager here (placement on its nodes, GPUs per actor, restarts of nothing:
a dead rank stays dead, as with processes); jaxinfer only tells each actor the addresses of
the API servers and the coordinator, which it connects to over TCP exactly like a headless
rank. With RAY_ADDRESS set (or a running `ray start` cluster) the actors go to that cluster,
else a local Ray instance is started. On a GPU cluster each actor asks for
--tensor-parallel-size GPUs (Ray sets its CUDA_VISIBLE_DEVICES); the head must then be
reachable from the other nodes at --data-parallel-address.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("jaxinfer.launcher")


def _actor_class():
    import ray

    @ray.remote
    class EngineCoreActor:
        def run(self, spec: dict) -> int:
            from jaxinfer.engine.core_proc import run_engine_core

            logging.basicConfig(level=logging.INFO)
            return run_engine_core(spec)

    return EngineCoreActor


class RayRanks:
    def __init__(self, rc, addrs, num_ranks: int):
        try:
            import ray
        except ImportError:
            raise ValueError("--data-parallel-backend ray needs Ray: pip install "
                             "'jaxinfer[ray]'") from None
        import jaxinfer
        from jaxinfer.engine.core_proc import core_spec

        self.ray = ray
        root = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))
        env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                             if p)}
        for name in ("JAX_PLATFORMS", "XLA_FLAGS", "JAXINFER_ENGINE_HEARTBEAT_TIMEOUT"):
            if name in os.environ:
                env[name] = os.environ[name]
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     runtime_env={"env_vars": env}, logging_level=logging.WARNING)
        on_cpu = os.environ.get("JAX_PLATFORMS", "").startswith("cpu")
        gpus = 0 if on_cpu or not ray.cluster_resources().get("GPU") else \
            rc.engine.tensor_parallel_size
        actor = _actor_class()
        self.actors, self.refs = [], []
        for rank in range(num_ranks):
            r = addrs.rank_spec(rank)
            spec = core_spec(rc, r["inputs"], r["outputs"], rank=rank,
                             coordinator=r["coordinator"], heartbeat=1.0)
            a = actor.options(name=None, num_cpus=0, num_gpus=gpus, runtime_env={
                "env_vars": {**env, "JAXINFER_DP_RANK": str(rank)}}).remote()
            self.actors.append(a)
            self.refs.append(a.run.remote(spec))
        self._reported: set[int] = set()
        logger.info("%d data-parallel ranks started as Ray actors (%s GPU each)", num_ranks,
                    gpus)

    def failed_at_start(self, table) -> bool:
        """Reports ranks whose actor ended; True if one ended before it ever came up."""
        done, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        fatal = False
        for ref in done:
            rank = self.refs.index(ref)
            if rank in self._reported:
                continue
            self._reported.add(rank)
            try:
                result = self.ray.get(ref)
            except Exception as e:  # the actor died (killed, node lost, failed start)
                result = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            if table[rank] is None:
                logger.error("Ray rank %d failed to start (%s): stopping", rank, result)
                fatal = True
            else:
                logger.error("Ray rank %d ended (%s); the API servers fail its requests and "
                             "keep serving on the other ranks", rank, result)
        return fatal

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:
                pass
        self.ray.shutdown()
