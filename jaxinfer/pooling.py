"""Pooling (embedding) models, the host side: the pooler a model folder asks for, PoolingParams
(per request: Matryoshka dimensions, normalization), the finishing of a pooled vector, and the
outputs LLM.embed / LLM.encode return (vLLM's names). The step pools on the device
(runner/step_fn.py: LAST / MEAN / CLS of the final hidden states); this module never imports
jax."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from jaxinfer.config.families import BARE_DECODERS
from jaxinfer.config.features import PoolerConfig

BASE_MODEL_ARCHITECTURES = tuple(BARE_DECODERS)

# sentence-transformers' pooling config key -> our pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


def sentence_transformers_pooler(model_dir: str) -> dict:
    """What a sentence-transformers folder (modules.json) says: {"pooling_type",
    "use_activation"} (the Normalize module), or {} when it has none."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        modules = json.load(f)
    out: dict = {"use_activation": any(str(m.get("type", "")).endswith("Normalize")
                                       for m in modules)}
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            cfg = os.path.join(model_dir, m.get("path") or "", "config.json")
            if os.path.isfile(cfg):
                with open(cfg) as f:
                    pooling = json.load(f)
                modes = [kind for key, kind in _ST_MODES.items() if pooling.get(key)]
                if len(modes) > 1:
                    raise ValueError(f"{cfg}: more than one pooling mode ({modes}); one of "
                                     "LAST, MEAN, CLS is supported")
                if not modes:
                    raise ValueError(f"{cfg}: none of the supported pooling modes (lasttoken, "
                                     "mean_tokens, cls_token) is set")
                out["pooling_type"] = modes[0]
    return out


def matryoshka_dimensions(model_dir: str) -> tuple[bool, tuple[int, ...] | None]:
    """(whether the model was trained for Matryoshka truncation, the sizes it lists)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    dims = cfg.get("matryoshka_dimensions")
    return bool(cfg.get("is_matryoshka") or dims), tuple(dims) if dims else None


@dataclass(frozen=True)
class ResolvedPooler:
    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    dimensions: int | None  # the default truncation (None: the hidden size)
    hidden_size: int
    matryoshka: bool
    matryoshka_dimensions: tuple[int, ...] | None


def resolve_pooler(config: PoolerConfig | None, model_dir: str,
                   hidden_size: int) -> ResolvedPooler:
    st = sentence_transformers_pooler(model_dir)
    config = config or PoolerConfig()
    kind = config.pooling_type or st.get("pooling_type") or "LAST"
    normalize = config.use_activation if config.use_activation is not None else \
        st.get("use_activation", True)
    matryoshka, dims = matryoshka_dimensions(model_dir)
    pooler = ResolvedPooler(kind, bool(normalize), None, hidden_size, matryoshka, dims)
    if config.dimensions is not None:
        check_dimensions(pooler, config.dimensions, "pooler_config.dimensions")
        pooler = replace(pooler, dimensions=config.dimensions)
    return pooler


def check_dimensions(pooler: ResolvedPooler, dimensions: int, name: str = "dimensions") -> None:
    """vLLM's rule: only a Matryoshka model may be truncated, to a size it lists (if it lists
    any), never beyond its hidden size."""
    if not pooler.matryoshka:
        raise ValueError(f"{name}: the model does not support matryoshka representation "
                         "(its config.json sets neither is_matryoshka nor "
                         "matryoshka_dimensions), so dimensions cannot be changed")
    if not 1 <= dimensions <= pooler.hidden_size:
        raise ValueError(f"{name}={dimensions} must be in [1, {pooler.hidden_size}] (the "
                         "hidden size)")
    if pooler.matryoshka_dimensions and dimensions not in pooler.matryoshka_dimensions:
        raise ValueError(f"{name}={dimensions} is not one of the model's "
                         f"matryoshka_dimensions {list(pooler.matryoshka_dimensions)}")


@dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's): dimensions: Matryoshka truncation (a model that supports it);
    use_activation / normalize: L2-normalize (None: the pooler's default)."""

    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None  # (the older name)
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens (-1: the limit)

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None:
            if self.use_activation not in (None, self.normalize):
                raise ValueError("normalize and use_activation disagree")
            object.__setattr__(self, "use_activation", bool(self.normalize))
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool)
                              or not (t == -1 or t >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {t!r}")

    def verify(self, pooler: ResolvedPooler) -> None:
        if self.dimensions is not None:
            check_dimensions(pooler, self.dimensions)


def finish(vector: np.ndarray, pooler: ResolvedPooler, params: PoolingParams | None
           ) -> np.ndarray:
    """The pooled vector as the request asked: truncated (Matryoshka), then normalized."""
    dims = (params.dimensions if params is not None and params.dimensions is not None
            else pooler.dimensions)
    v = np.asarray(vector, np.float32)
    if dims is not None:
        v = v[:dims]
    norm = params.use_activation if params is not None and params.use_activation is not None \
        else pooler.normalize
    if norm:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v


# -- outputs (vLLM's classes; data as numpy arrays where vLLM has torch tensors) ------------------
@dataclass
class PoolingOutput:
    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float] = field(default_factory=list)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput  # (the same fields; the vector as a list)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
