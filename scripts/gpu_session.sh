#!/usr/bin/env bash
# Everything a session with a lent GPU should run, one phase per device call (a call may run
# 10 minutes; a session has 30 minutes of device time). Run from the repo root on the GPU
# machine; results and raw logs land in $OUT (the device tool brings back 8 files per call):
#
#   bash scripts/gpu_session.sh tests     # native kernel tests + the engine with the kernel
#   bash scripts/gpu_session.sh kernels   # benchmarks/kernels.py with the tuning sweep
#   bash scripts/gpu_session.sh latency   # Llama-3.1-8B-shaped dummy model: roofline and
#                                         # latency at batch 1/8/32 (128 in, 128 out)
#   bash scripts/gpu_session.sh throughput  # the same model on the nano-vllm workload
#   bash scripts/gpu_session.sh hf        # HF transformers (continuous batching), same workload
#   bash scripts/gpu_session.sh all       # one call of under 9 minutes, most valuable first:
#                                         # native tests + engine parity, kernels (+ sweep),
#                                         # 8B-shaped latency at batch 32 and 1 (whole steps)
#
# Then commit the JSON + logs under benchmarks/results/ and copy the sweep's best tunings into
# pallas_kernels/tuning.py. SMOKE=1 runs every phase at toy sizes on a CPU (a check of this
# script, not a measurement).
#
# The GPU image lacks msgspec and pyzmq (import jaxinfer needs msgspec). Download them here
# into .whl/ (git-ignored) and carry it (`carry: [".whl"]`); this script installs them first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl msgspec pyzmq
set -uo pipefail
phase=${1:?usage: gpu_session.sh all|tests|kernels|latency|throughput|hf}
OUT=${OUT:-/tmp/jaxinfer-gpu}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
if [ "$SMOKE" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/jaxinfer-site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/jaxinfer-site
fi
dev=$($PY -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_').lower())")
echo "device: $dev  jax: $($PY -c 'import jax; print(jax.__version__)')  phase: $phase"

case "$phase" in
all)
    # Each part has its own time cap and writes its results as soon as it ends, so a cut-off
    # run still brings the earlier parts back. Caps sum to ~530 s. The tests print one line each
    # (-v), so a cut-off run still says which passed. One after another they took ~300 s on an
    # H200 (2026-11-30: 25 tests, most of it compiling on the host), so with pytest-xdist (in
    # the GPU image) four workers share them, each allocating GPU memory on demand; that took
    # over 200 s (23 of 25 had passed at 200 s). The cap interrupts pytest (SIGINT) so that its
    # workers stop too instead of running on beside the kernel timings.
    nvidia-smi -L 2>&1 | tee "$OUT/all_$dev.log"
    sel=(-m gpu tests/pallas_kernels tests/engine/test_gpu_pallas_engine.py)
    [ "$SMOKE" = 1 ] && sel=(tests/pallas_kernels/test_tuning.py -k lookup)
    workers=()
    $PY -c "import xdist" 2>/dev/null && workers=(-n 4)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 15 250 \
        $PY -m pytest -v -p no:cacheprovider "${workers[@]}" "${sel[@]}" 2>&1 \
        | tee "$OUT/gpu_tests_$dev.log"
    kargs=(--sweep --batches 1,8,32,128 --contexts 512,4096,32768
           --output-json "$OUT/kernels_$dev.json")
    [ "$SMOKE" = 1 ] && kargs+=(--smoke --interpret --no-torch)
    timeout 100 $PY benchmarks/kernels.py "${kargs[@]}" 2>&1 | tee "$OUT/kernels_$dev.log"
    model=benchmarks/configs/llama-3.1-8b
    common=(--load-format dummy --dtype bfloat16 --skip-tokenizer-init --attention-backend pallas
            --step-compilation whole --warmup-buckets start --max-num-seqs 32)
    lat=(--input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 2)
    if [ "$SMOKE" = 1 ]; then
        model=benchmarks/configs/tiny-llama
        common=(--load-format dummy --dtype float32 --skip-tokenizer-init --max-num-seqs 4
                --num-kv-blocks 64 --no-warmup)
        lat=(--input-len 8 --output-len 4 --num-iters 1)
    fi
    for bs in 32 1; do
        [ "$SMOKE" = 1 ] && [ "$bs" = 32 ] && bs=4
        timeout $([ "$bs" = 1 ] && echo 40 || echo 140) $PY -m jaxinfer.entrypoints.cli bench \
            latency --model "$model" "${common[@]}" "${lat[@]}" --batch-size "$bs" \
            --output-json "$OUT/latency_llama8b_bs${bs}_$dev.json" 2>&1 \
            | tee -a "$OUT/all_$dev.log"
    done
    ;;
tests)
    if [ "$SMOKE" = 1 ]; then sel=(tests/pallas_kernels/test_tuning.py -k lookup); else
        sel=(-m gpu tests/pallas_kernels); fi
    timeout 540 $PY -m pytest -q -p no:cacheprovider "${sel[@]}" 2>&1 | tee "$OUT/gpu_tests_$dev.log"
    # The engine end to end with the kernel (natively on a GPU) vs HF transformers' greedy.
    timeout 300 $PY -m pytest -q -p no:cacheprovider tests/engine/test_llm_greedy.py -k pallas \
        2>&1 | tee -a "$OUT/gpu_tests_$dev.log"
    ;;
kernels)
    args=(--sweep --output-json "$OUT/kernels_$dev.json")
    [ "$SMOKE" = 1 ] && args+=(--smoke --interpret --no-torch)
    timeout 560 $PY benchmarks/kernels.py "${args[@]}" 2>&1 | tee "$OUT/kernels_$dev.log"
    ;;
latency | throughput | hf)
    model=benchmarks/configs/llama-3.1-8b
    common=(--load-format dummy --dtype bfloat16 --skip-tokenizer-init --attention-backend pallas)
    thr=(--dataset nano-vllm)
    lat=(--input-len 128 --output-len 128 --num-iters 3)
    sizes="1 8 32"
    if [ "$SMOKE" = 1 ]; then
        model=$OUT/tiny
        mkdir -p "$model"
        $PY -c "import json; json.dump(dict(architectures=['LlamaForCausalLM'], model_type='llama',
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=1e4, eos_token_id=2), open('$model/config.json', 'w'))"
        common=(--load-format dummy --dtype float32 --skip-tokenizer-init --max-num-seqs 4
                --num-kv-blocks 64 --no-warmup)
        thr=(--dataset random --num-prompts 4 --input-len 16 --output-len 4)
        lat=(--input-len 8 --output-len 4 --num-iters 1)
        sizes="1"
    fi
    log="$OUT/${phase}_$dev.log"
    if [ "$phase" = latency ]; then
        timeout 60 $PY -m jaxinfer.entrypoints.cli bench roofline --model "$model" \
            --dtype bfloat16 --output-json "$OUT/roofline_llama8b_$dev.json" 2>&1 | tee "$log"
        for bs in $sizes; do
            timeout 170 $PY -m jaxinfer.entrypoints.cli bench latency --model "$model" \
                "${common[@]}" "${lat[@]}" --batch-size "$bs" \
                --output-json "$OUT/latency_llama8b_bs${bs}_$dev.json" 2>&1 | tee -a "$log"
        done
    elif [ "$phase" = throughput ]; then
        timeout 560 $PY -m jaxinfer.entrypoints.cli bench throughput --model "$model" \
            "${common[@]}" "${thr[@]}" --no-tqdm \
            --output-json "$OUT/throughput_llama8b_$dev.json" 2>&1 | tee "$log"
    else  # HF transformers' continuous batching on the same workload (torch, no JAX)
        hf=(--load-format dummy --mode continuous "${thr[@]}")
        [ "$SMOKE" = 1 ] && hf=(--load-format dummy --dtype float32 --mode static "${thr[@]}")
        timeout 560 $PY benchmarks/baselines/hf_transformers.py --model "$model" "${hf[@]}" \
            --output-json "$OUT/hf_llama8b_$dev.json" 2>&1 | tee "$log"
    fi
    ;;
*)
    echo "unknown phase $phase (tests|kernels|latency|throughput|hf)" >&2
    exit 2
    ;;
esac
