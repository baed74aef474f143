"""Compile the Pallas attention kernel for Hopper without a GPU, and report what ptxas says.

The Pallas Triton lowering turns the kernel into a Triton IR module (TTIR) that XLA compiles on
the GPU machine. Here we capture that module for an abstract H100, compile it with the `triton`
package (a torch dependency, so it is in the test environment) for sm_90a, and run its bundled
`ptxas -v`. That catches, on a CPU-only machine, what would otherwise only show on a GPU: IR that
Triton rejects, tiles that need more shared memory than an SM has, register spills, K/V loads
that are not 16-byte vectorised, and the resulting occupancy. It measures no time.

    PYTHONPATH=. python -m pallas_kernels.compile_report --output-json out.json

Caveat: XLA's GPU backend embeds its own Triton build, which may differ in version from the
`triton` package used here, so this is a close proxy for the GPU build, not the same compiler.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tuning import _TABLE, AttentionTuning, attention_tuning

# Hopper (sm_90) per-SM limits: H100 and H200 share them.
SM90 = {"regs_per_sm": 65536, "max_warps_per_sm": 64, "max_blocks_per_sm": 32,
        "smem_per_sm": 233472, "max_smem_per_block": 232448, "smem_reserved_per_block": 1024}


@dataclasses.dataclass(frozen=True)
class KernelShape:
    name: str
    num_tokens: int  # T
    num_seqs: int  # R
    max_kv_len: int  # sets max_blocks and with it the automatic split-KV choice
    head_dim: int
    block_size: int
    dtype: str
    num_q_heads: int = 32
    num_kv_heads: int = 8
    num_splits: int | None = None
    tuning: AttentionTuning | None = None  # None: the tuning table's choice


def shipped_shapes() -> list[KernelShape]:
    """Decode, long-context decode (split-KV) and prefill for every tuning-table entry, at
    Llama-3-8B heads, plus float32 and the chunked head dims 80/96."""
    configs = sorted({(d, bs, dt) for (d, bs, dt, _) in _TABLE}
                     | {(128, 16, "float32"), (80, 16, "bfloat16"), (96, 16, "bfloat16")})
    out = []
    for d, bs, dt in configs:
        tag = f"d{d}-bs{bs}-{dt}"
        out += [KernelShape(f"decode-{tag}", 64, 64, 2048, d, bs, dt),
                KernelShape(f"decode-long-{tag}", 8, 8, 16384, d, bs, dt),
                KernelShape(f"prefill-{tag}", 2048, 8, 4096, d, bs, dt)]
    return out


@contextlib.contextmanager
def _capture_ttir(sink: list[str]):
    from jax._src.pallas.triton import lowering

    orig = lowering.lower_jaxpr_to_triton_module

    def wrapped(*args, **kwargs):
        result = orig(*args, **kwargs)
        sink.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = orig


def lower_to_ttir(shape: KernelShape) -> tuple[str, dict[str, int]]:
    """The kernel's Triton IR for an abstract H100, and the launch parameters XLA would use."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="cuda"))
    s, dt = jax.ShapeDtypeStruct, jnp.dtype(shape.dtype)
    max_blocks = -(-shape.max_kv_len // shape.block_size)
    num_blocks = shape.num_seqs * max_blocks + 1
    cache = s((num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim), dt)
    args = (s((shape.num_tokens, shape.num_q_heads, shape.head_dim), dt), cache, cache,
            s((shape.num_seqs,), jnp.int32), s((shape.num_seqs, max_blocks), jnp.int32),
            s((shape.num_seqs + 1,), jnp.int32), s((1,), jnp.int32))
    sink: list[str] = []
    jax.clear_caches()
    with _capture_ttir(sink), jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_paged_attention(
            *a, sm_scale=shape.head_dim ** -0.5, num_splits=shape.num_splits,
            tuning=shape.tuning)).trace(
                *args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    launch = {k: int(v) for k, v in re.findall(
        r"\b(num_warps|num_stages|grid_x|grid_y|grid_z) = (\d+)", text)}
    if len(sink) != 1 or len(launch) != 5:
        raise RuntimeError(f"{shape.name}: expected one Triton kernel, got {len(sink)}")
    return sink[0], launch


def _ptxas(arch: int) -> str:
    """The ptxas that triton itself uses for this arch (its PTX version matches)."""
    path = None
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except (ImportError, AttributeError):
        path = shutil.which("ptxas")
    if not path:
        raise RuntimeError("no ptxas: neither triton's bundled one nor one on PATH")
    return path


def occupancy(regs: int, shared: int, num_warps: int, limits=SM90) -> int:
    """Resident blocks per SM allowed by warps, registers and shared memory."""
    regs_per_block = -(-regs // 8) * 8 * 32 * num_warps
    by_regs = limits["regs_per_sm"] // regs_per_block if regs else limits["max_blocks_per_sm"]
    by_smem = limits["smem_per_sm"] // (shared + limits["smem_reserved_per_block"])
    by_warps = limits["max_warps_per_sm"] // num_warps
    return min(by_regs, by_smem, by_warps, limits["max_blocks_per_sm"])


def compile_report(shape: KernelShape, arch: int = 90) -> dict:
    """Lower, compile with Triton for sm_<arch>a, and summarise ptxas' view of the kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    ttir, launch = lower_to_ttir(shape)
    row = {**dataclasses.asdict(shape), **launch}
    row["tuning"] = dataclasses.asdict(attention_tuning(
        shape.head_dim, shape.block_size, shape.dtype, shape.num_tokens, shape.tuning))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ragged_paged_attention.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "cache"))
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said aloud
        kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32), options={
            "num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})
        ptx = kernel.asm["ptx"]
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(arch), "-v", f"-arch=sm_{arch}a", ptx_path, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{shape.name}: ptxas failed: {res.stderr[-2000:]}")
    log = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill_st, spill_ld = map(int, re.search(
        r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    mma = sorted(set(re.findall(r"\b(wgmma\.mma_async\.sync|mma\.sync)\.aligned\.(\w+)", ptx)))
    row.update(
        triton_version=triton.__version__, arch=f"sm_{arch}a",
        shared_bytes=int(kernel.metadata.shared), registers=regs,
        spill_store_bytes=spill_st, spill_load_bytes=spill_ld,
        cp_async_16B=len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
        ld_global_v4=len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
        mma=[f"{a}.{b}" for a, b in mma],
        blocks_per_sm=occupancy(regs, int(kernel.metadata.shared), launch["num_warps"]),
        programs=launch["grid_x"] * launch["grid_y"] * launch["grid_z"],
    )
    return row


def sweep_candidates(regime: str) -> list[AttentionTuning]:
    # num_stages 3 was measured to allocate no more shared memory than 2 here (Triton does not
    # deepen this loop's pipeline), so the sweep keeps 2.
    if regime == "decode":  # few rows per program, bandwidth bound
        grid = [(bm, kv, w) for bm in (16, 32) for kv in (32, 64, 128) for w in (4, 8)]
    else:
        grid = [(bm, kv, w) for bm in (64, 128) for kv in (32, 64) for w in (4, 8)]
    return [AttentionTuning(bm, kv, w, 2) for bm, kv, w in grid]


def _regime(shape: KernelShape) -> str:
    return "decode" if shape.num_tokens <= 256 else "prefill"


def pick(rows: list[dict]) -> dict | None:
    """Heuristic choice among one regime's candidates from compile statistics alone (no
    timing). A candidate must compile without spills for every shape of the regime. Decode then
    maximises the K/V buffer resident per SM (blocks x shared memory: bytes in flight),
    prefill the query rows resident per SM, then the tile sizes (K/V reuse); ties go to fewer
    registers."""
    by_tuning: dict[tuple, list[dict]] = {}
    for r in rows:
        by_tuning.setdefault(tuple(r["tuning"].values()), []).append(r)

    def ok(rs):
        return all(r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
                   and r["blocks_per_sm"] > 0 for r in rs)

    def score(rs):
        t = rs[0]["tuning"]
        regs = sum(r["registers"] for r in rs)
        if rs[0]["num_tokens"] <= 256:
            return (sum(r["blocks_per_sm"] * r["shared_bytes"] for r in rs), -regs)
        return (sum(r["blocks_per_sm"] * t["block_m"] for r in rs), t["block_m"],
                t["kv_tokens_per_iter"], -regs)

    good = [rs for rs in by_tuning.values() if ok(rs)]
    return max(good, key=score)[0]["tuning"] if good else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-json")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--sweep", action="store_true",
                    help="compile every candidate tuning per table entry and pick one (no timing)")
    args = ap.parse_args(argv)
    rows, picks = [], {}
    shapes = [s for s in shipped_shapes()
              if not args.only or any(o in s.name for o in args.only.split(","))]
    groups: dict[tuple, list[KernelShape]] = {}
    for shape in shapes:
        key = (shape.head_dim, shape.block_size, shape.dtype, _regime(shape))
        groups.setdefault(key, []).append(shape)
    for key, group in groups.items():
        group_rows = []
        for tune in sweep_candidates(key[3]) if args.sweep else [None]:
            for shape in group:
                row = compile_report(dataclasses.replace(shape, tuning=tune), args.arch)
                group_rows.append(row)
                _print_row(row)
        rows += group_rows
        if args.sweep:
            picks["/".join(map(str, key))] = best = pick(group_rows)
            print(f"  -> {key}: {best}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": " ".join(["python -m pallas_kernels.compile_report",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "jax_version": jax.__version__, "limits": SM90, "kernels": rows,
                       "picks": picks}, f, indent=1)
    return 0


def _print_row(row: dict) -> None:
    t = row["tuning"]
    print(f"{row['name']:31s} bm={t['block_m']:3d} kv={t['kv_tokens_per_iter']:3d} "
          f"warps={row['num_warps']} stages={row['num_stages']} "
          f"programs={row['programs']:6d} smem={row['shared_bytes']:6d} "
          f"regs={row['registers']:3d} spills={row['spill_store_bytes']}/"
          f"{row['spill_load_bytes']} blocks/SM={row['blocks_per_sm']} "
          f"cp.async16B={row['cp_async_16B']} mma={','.join(row['mma'])}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
