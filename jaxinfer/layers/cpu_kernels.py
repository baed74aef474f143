"""The `cpu` backend's C++ kernels, XLA FFI custom calls on XLA's intra-op thread pool.

- ragged paged attention (jaxinfer/csrc/paged_attention_cpu.cc): reads each KV page in place
  and does only the attention math;
- packed matmul (jaxinfer/csrc/packed_matmul_cpu.cc): x @ W with W packed at load time into
  column panels [ceil(N/32), K, 32] (`pack`): the weights stream once per step, the rows of x
  stay in cache (benchmarks/cpu_matmul.py, results/cpu_matmul.json: on this CPU 10-20% faster
  than XLA's dot at 8-32 rows, level at 256, 9% faster at 1024, within noise at 1); and its
  grouped form for mixture-of-experts layers (rows sorted by expert, each expert's own
  packed weight; experts no row chose are not read);
- RMSNorm (rms_norm_cpu.cc), the KV cache write, and greedy sampling's argmax
  (argmax_cpu.cc: one pass per row where XLA made three, each with a thread-pool hand-off).

All are compiled here into one library, on first use, with the machine's C++ compiler against
the FFI headers jaxlib ships (no network), into the cache folder (<cache>/ext, keyed by the
sources, jaxlib's version, the compiler flags and this CPU's instruction-set flags), under a
file lock so concurrent engine processes build it once. `make setup` builds it ahead. Where it
cannot be built (no compiler), `available()` says so, the reason is logged once, and the
default backend on CPU stays `xla` (unpacked weights, XLA's dots).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxinfer_paged_attention_cpu"
MATMUL_TARGET = "jaxinfer_packed_matmul_cpu"
GROUPED_MATMUL_TARGET = "jaxinfer_grouped_matmul_cpu"
QUANT_MATMUL_TARGET = "jaxinfer_quant_matmul_cpu"
GROUPED_QUANT_MATMUL_TARGET = "jaxinfer_grouped_quant_matmul_cpu"
GATED_MATMUL_TARGET = "jaxinfer_gated_matmul_cpu"
GATED_QUANT_MATMUL_TARGET = "jaxinfer_gated_quant_matmul_cpu"
RMS_NORM_TARGET = "jaxinfer_rms_norm_cpu"
# The gated MLP activations the gated matmuls apply (act(gate) * up), by config name.
GATED_ACTS = {"silu": 1, "gelu_pytorch_tanh": 2}
KV_WRITE_TARGET = "jaxinfer_kv_write_cpu"
ARGMAX_TARGET = "jaxinfer_argmax_cpu"
_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
_SOURCES = [os.path.join(_CSRC, f) for f in ("paged_attention_cpu.cc", "packed_matmul_cpu.cc",
                                              "rms_norm_cpu.cc", "argmax_cpu.cc")]
_HEADERS = [os.path.join(_CSRC, "cpu_common.h")]
PANEL = 32  # packed weights: column panels of this many outputs (kNR in the kernel)
# -ffast-math lets GCC call glibc's vector exp (libmvec); the kernels use no infinities or NaNs
# (a finite mask value; positions outside a row's window are never read). Compile flags only:
# linking with -ffast-math would add crtfastmath.o, whose constructor turns on flush-to-zero
# for the whole process when the library loads (subnormals would vanish from every numpy and
# XLA computation of the engine: a test catches it).
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-std=c++17", "-fPIC"]
_LINK_FLAGS = ["-shared"]
_RECIPE = "compile-then-link"  # (part of the cache key: a build made another way never matches)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def _cache_dir() -> str:
    from jaxinfer.checkpoints.cache import cache_dir

    return os.path.join(cache_dir(), "ext")


def library_path() -> str:
    import jaxlib

    key = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        with open(src, "rb") as f:
            key.update(f.read())
    key.update(" ".join([_RECIPE, *_FLAGS, "|", *_LINK_FLAGS, jaxlib.__version__,
                         _cpu_flags()]).encode())
    return os.path.join(_cache_dir(), f"cpu_kernels-{key.hexdigest()[:16]}.so")


def build() -> str:
    """Compile the kernels unless this exact build exists; returns the library's path."""
    import fcntl

    path = library_path()
    if os.path.isfile(path):
        return path
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") \
        or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(path):  # another process built it meanwhile
            return path
        tmp = f"{path}.{os.getpid()}.tmp"
        objects = [f"{tmp}.{i}.o" for i in range(len(_SOURCES))]
        cmds = [[cxx, *_FLAGS, "-I", _CSRC, "-I", jax.ffi.include_dir(), "-c", src, "-o", obj]
                for src, obj in zip(_SOURCES, objects)]
        cmds.append([cxx, *_LINK_FLAGS, *objects, "-o", tmp, "-lm"])
        try:
            for cmd in cmds:
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        finally:
            for obj in objects:
                if os.path.exists(obj):
                    os.remove(obj)
        os.replace(tmp, path)  # atomic: a reader never sees half a library
    return path


@functools.cache
def available() -> bool:
    """Whether the kernels are built (building them now if needed) and registered with XLA.
    JAXINFER_CPU_ATTENTION: "1" (default) or "0" (off: the xla backend); anything else is
    refused."""
    value = os.environ.get("JAXINFER_CPU_ATTENTION", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"JAXINFER_CPU_ATTENTION={value!r}: use 0 or 1")
    if value == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        for target, symbol in ((TARGET, "JaxinferPagedAttentionCpu"),
                               (MATMUL_TARGET, "JaxinferPackedMatmulCpu"),
                               (GROUPED_MATMUL_TARGET, "JaxinferGroupedMatmulCpu"),
                               (QUANT_MATMUL_TARGET, "JaxinferQuantMatmulCpu"),
                               (GROUPED_QUANT_MATMUL_TARGET, "JaxinferGroupedQuantMatmulCpu"),
                               (GATED_MATMUL_TARGET, "JaxinferGatedMatmulCpu"),
                               (GATED_QUANT_MATMUL_TARGET, "JaxinferGatedQuantMatmulCpu"),
                               (RMS_NORM_TARGET, "JaxinferRmsNormCpu"),
                               (KV_WRITE_TARGET, "JaxinferKvWriteCpu"),
                               (ARGMAX_TARGET, "JaxinferArgmaxCpu")):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except Exception as e:  # noqa: BLE001  (any build or load failure: fall back, say why)
        logger.warning("cpu kernels unavailable, using the xla backend: %s", e)
        return False
    return True


def ragged_paged_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                               num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                               sinks=None):
    """Same contract as `ragged_paged_attention_reference`; q [T, Hq, D] -> [T, Hq, D];
    sinks: float32 [Hq] attention sinks, or None."""
    if not available():
        raise RuntimeError("attention_backend='cpu' needs the C++ kernel, which could not be "
                           "built here (see the warning above)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    i32 = np.int32
    return call(q, k_cache, v_cache, kv_lens.astype(i32), block_tables.astype(i32),
                query_start_loc.astype(i32), num_seqs.astype(i32),
                jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0))


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping):
    """`write_kv_reference`'s contract, in place: the outputs alias the caches (donated caches
    are written where they are; XLA copies one that is not). k, v in the caches' dtype."""
    if not available():
        raise RuntimeError("write_kv_cpu needs the C++ kernels, which could not be built here")
    out = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
           jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, out, vmap_method="sequential",
                            input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, k, v, slot_mapping.astype(np.int32))


def argmax(x):
    """Each row's argmax, x float32 [R, V] -> int32 [R]: the first maximum, or the first NaN
    where a row has one (jnp.argmax's contract), in one pass per row."""
    if not available():
        raise RuntimeError("argmax needs the C++ kernels, which could not be built here")
    call = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:1], np.int32),
                            vmap_method="sequential")
    return call(x.astype(np.float32))


def packed_shape(in_features: int, out_features: int) -> tuple[int, int, int]:
    return (-(-out_features // PANEL), in_features, PANEL)


def pack(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [ceil(N/32), K, 32] column panels, the last zero-padded."""
    k, n = w.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), w.dtype)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, panels, PANEL).transpose(1, 0, 2))


# Row and result dtypes the matmul kernels take and give as they are (they compute in float32:
# bfloat16 rows widen exactly inside, bfloat16 results round to nearest even as XLA's convert
# does), so no convert fusion runs around them.
KERNEL_IO_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def _kernel_io(x, out_features: int, out_dtype):
    """(x as [M, K] in a dtype the kernel takes, the kernel's result type, the dtype wanted)."""
    dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in KERNEL_IO_DTYPES:
        x2 = x2.astype(np.float32)
    kernel_dtype = dtype if dtype in KERNEL_IO_DTYPES else np.dtype(np.float32)
    return x2, jax.ShapeDtypeStruct((x2.shape[0], out_features), kernel_dtype), dtype


def matmul(x, w_packed, out_features: int, scale=None, offset=None, out_dtype=None):
    """x [..., K] @ the packed weight [P, K, 32] (float32 or bfloat16) -> [..., out_features]
    in x's dtype (the kernel computes in float32). Quantized (int8 / fp8 e4m3 panels): scale
    float32 [P, K / G, 32] (packed as the weight: `pack` of the [K / G, N] scales), one per
    output column and group of G input rows, and optionally an offset of the same shape
    (w = q * scale + offset). out_dtype: the result's (default x's)."""
    if not available():
        raise RuntimeError("packed weights need the C++ kernels, which could not be built here")
    lead = x.shape[:-1]
    x2, out, dtype = _kernel_io(x, out_features, out_dtype)
    if scale is None:
        call = jax.ffi.ffi_call(MATMUL_TARGET, out, vmap_method="sequential")
        y = call(x2, w_packed)
    else:
        if offset is None:
            offset = jax.numpy.zeros((0,), np.float32)
        call = jax.ffi.ffi_call(QUANT_MATMUL_TARGET, out, vmap_method="sequential")
        y = call(x2, w_packed, scale, offset)
    return y.reshape(*lead, out_features).astype(dtype)


def gated_matmul(x, w_packed, out_features: int, act: str, scale=None, offset=None,
                 out_dtype=None):
    """A gated MLP's down projection from the gate-up product: x [..., 2K] (gate, then up)
    -> (act(gate) * up) @ the packed weight [P, K, 32] -> [..., out_features] in out_dtype
    (default x's); the activation is computed in float32 inside the kernel, the rows never
    leave it. act: a GATED_ACTS name; scale / offset as in `matmul`."""
    if not available():
        raise RuntimeError("packed weights need the C++ kernels, which could not be built here")
    if act not in GATED_ACTS:
        raise ValueError(f"gated_matmul: act {act!r} is not one of {sorted(GATED_ACTS)}")
    lead = x.shape[:-1]
    x2, out, dtype = _kernel_io(x, out_features, out_dtype)
    code = np.int64(GATED_ACTS[act])
    if scale is None:
        call = jax.ffi.ffi_call(GATED_MATMUL_TARGET, out, vmap_method="sequential")
        y = call(x2, w_packed, act=code)
    else:
        if offset is None:
            offset = jax.numpy.zeros((0,), np.float32)
        call = jax.ffi.ffi_call(GATED_QUANT_MATMUL_TARGET, out, vmap_method="sequential")
        y = call(x2, w_packed, scale, offset, act=code)
    return y.reshape(*lead, out_features).astype(dtype)


def rms_norm(x, weight, eps: float, *, residual=None, unit_offset: bool = False):
    """RMSNorm of rows x [..., H] (float32 or bfloat16) with weight [H], as layers/norms.py
    computes it (float32 inside, each result rounded to x's dtype where it does); with a
    residual of x's shape, (x + residual in x's dtype, the norm of that sum)."""
    if not available():
        raise RuntimeError("rms_norm needs the C++ kernels, which could not be built here")
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    r2 = jax.numpy.zeros((0,), x.dtype) if residual is None else residual.reshape(-1, h)
    out = (jax.ShapeDtypeStruct(x2.shape if residual is not None else (0,), x.dtype),
           jax.ShapeDtypeStruct(x2.shape, x.dtype))
    call = jax.ffi.ffi_call(RMS_NORM_TARGET, out, vmap_method="sequential")
    s, y = call(x2, r2, weight.astype(x.dtype), eps=np.float32(eps),
                unit_offset=np.int64(bool(unit_offset)))
    return y.reshape(x.shape) if residual is None else (s.reshape(x.shape), y.reshape(x.shape))


def grouped_matmul(x, w_packed, group_sizes, out_features: int, scale=None):
    """Mixture-of-experts rows: x [M, K], sorted by expert, group_sizes int32 [E] (rows of
    each expert, in order), w_packed [E, P, K, 32] (each expert packed; float32 or bfloat16
    panels) -> [M, N] in x's dtype;
    rows past sum(group_sizes) come back zero. Quantized experts (int8 / fp8 e4m3): scale
    [E, P, K / G, 32], each expert's scales packed as its weight."""
    if not available():
        raise RuntimeError("packed weights need the C++ kernels, which could not be built here")
    dtype, x = x.dtype, x.astype(np.float32)
    out = jax.ShapeDtypeStruct((x.shape[0], out_features), np.float32)
    if scale is None:
        call = jax.ffi.ffi_call(GROUPED_MATMUL_TARGET, out, vmap_method="sequential")
        return call(x, w_packed, group_sizes.astype(np.int32)).astype(dtype)
    call = jax.ffi.ffi_call(GROUPED_QUANT_MATMUL_TARGET, out, vmap_method="sequential")
    return call(x, w_packed, scale, group_sizes.astype(np.int32)).astype(dtype)


# Model dtypes whose weights the kernel takes packed as they are (bfloat16 ones widen exactly
# to float32 as they load; activations and sums are float32 either way).
PACKED_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def use_packed_weights(attention_backend: str, dtype, mesh) -> bool:
    """Packed weights and the matmul kernel go with the `cpu` backend: float32 and bfloat16
    models on one device (under a mesh XLA could not partition the custom call)."""
    return attention_backend == "cpu" and mesh is None and np.dtype(dtype) in PACKED_DTYPES
