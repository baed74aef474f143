"""jaxinfer: a JAX/Pallas reimplementation of the vLLM V1 inference engine.

`from jaxinfer import LLM, SamplingParams` is light: the engine (and jax) load on first use.
"""

from jaxinfer.lora.request import LoRARequest
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.pooling import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "LoRARequest", "PoolingParams", "PoolingRequestOutput",
           "EmbeddingRequestOutput"]


def __getattr__(name):
    if name == "LLM":
        from jaxinfer.llm import LLM

        return LLM
    raise AttributeError(name)
