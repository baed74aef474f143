"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys), over full blocks only.
Extra keys, on the first block (they chain onward): the request's cache_salt and its LoRA
adapter's name and folder (a base-model request and an adapter's never share KV; vLLM 0.32
keys on both too); on every block that holds an image's tokens, that image's identifier (two
prompts with the same text and different images never share KV). The root parent hash comes
from a seed, so hashes are deterministic across processes for a fixed seed.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from typing import Any, Sequence

from jaxinfer.multimodal.inputs import block_mm_keys

HASH_ALGOS = ("sha256", "builtin")


def none_hash(seed: int | str = 0) -> bytes:
    """The parent hash of a first block."""
    return hashlib.sha256(f"jaxinfer-prefix-cache-root:{seed}".encode()).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None, algo: str = "sha256") -> bytes:
    tokens = array("q", token_ids).tobytes()
    extra = pickle.dumps(extra_keys, protocol=5) if extra_keys else b""
    if algo == "sha256":
        h = hashlib.sha256(parent_hash)
        h.update(len(tokens).to_bytes(4, "little"))
        h.update(tokens)
        h.update(extra)
        return h.digest()
    if algo == "builtin":
        # Faster, but only stable within one process (str/bytes hashing is randomized).
        return hash((parent_hash, tokens, extra)).to_bytes(8, "little", signed=True)
    raise ValueError(f"prefix_caching_hash_algo={algo!r} is not supported ({', '.join(HASH_ALGOS)})")


def block_extra_keys(block_index: int, cache_salt: str | None,
                     lora_request=None, mm_keys: tuple = ()) -> tuple[Any, ...] | None:
    """Extra keys of one block. Only the first block carries the salt and the adapter;
    mm_keys: the identifiers of the images with tokens in this block."""
    keys = ("mm", *mm_keys) if mm_keys else ()
    if block_index != 0:
        return keys or None
    if cache_salt:
        keys += ("salt", cache_salt)
    if lora_request is not None:
        keys += ("lora", lora_request.lora_name, lora_request.lora_path)
    return keys or None


def update_block_hashes(request, block_size: int, root_hash: bytes, algo: str = "sha256") -> None:
    """Extend request.block_hashes to cover every full block of request.all_token_ids."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    features = getattr(request, "mm_features", ())
    num_full = len(tokens) // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else root_hash
        block = tokens[i * block_size : (i + 1) * block_size]
        mm = block_mm_keys(features, i, block_size) if features else ()
        hashes.append(hash_block_tokens(parent, block, block_extra_keys(
            i, request.cache_salt, getattr(request, "lora_request", None), mm), algo))
