// Shared by the cpu backend's kernels: 16-float vectors and how many helper threads a kernel
// asks XLA's intra-op pool for.

#pragma once

#include <sched.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

namespace jaxinfer_cpu {

// 16 floats at any 4-byte-aligned address (aligned(4): unaligned vector loads and stores;
// may_alias: they may read and write float arrays). Loads and stores are plain vector
// accesses, not memcpy: on CPUs where GCC prefers 256-bit vectors (AVX-512 server parts:
// -march=native sets -mprefer-vector-width=256), a 64-byte memcpy became two 32-byte moves
// through the stack and a 64-byte reload, a store-forwarding stall on every load, and the
// accumulators were spilled each iteration: the packed matmul ran at 23 GFLOP/s on one core
// where XLA's dot ran at 65-144 (benchmarks/cpu_matmul.py). v16 is that vector (gv16) except
// on AVX2-only CPUs (below).
typedef float gv16 __attribute__((vector_size(64), aligned(4), may_alias));

inline gv16 gload16(const float* p) { return *reinterpret_cast<const gv16*>(p); }

inline void gstore16(float* p, gv16 v) { *reinterpret_cast<gv16*>(p) = v; }

#if defined(__AVX2__) && !defined(__AVX512F__)
// v16 on CPUs with AVX2 but no AVX-512 (AMD Zen 2 / 3, older Intel): two 8-float vectors.
// GCC 12 lowers a 64-byte generic vector on such a CPU through the stack (each broadcast
// stored lane by lane, every accumulator reloaded per FMA): the packed matmul ran at
// 2.3 GFLOP/s per core on an AVX2 EPYC, 4x below XLA's dot. The pair keeps each half in a
// ymm register. Byte -> float widening below goes 8 lanes at a time with AVX2 intrinsics, the
// halves joined in registers (GCC's generic conversions of 16 bytes were scalarised).
#define JAXINFER_V16_PAIR 1
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

struct v16 {
  v8 lo, hi;
  v16& operator+=(v16 o) { lo += o.lo; hi += o.hi; return *this; }
  v16& operator-=(v16 o) { lo -= o.lo; hi -= o.hi; return *this; }
  v16& operator*=(v16 o) { lo *= o.lo; hi *= o.hi; return *this; }
  float operator[](int64_t i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};

#define JAXINFER_V16_OP(OP)                                                           \
  inline v16 operator OP(v16 a, v16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; }       \
  inline v16 operator OP(v16 a, float b) { return {a.lo OP b, a.hi OP b}; }           \
  inline v16 operator OP(float a, v16 b) { return {a OP b.lo, a OP b.hi}; }
JAXINFER_V16_OP(+)
JAXINFER_V16_OP(-)
JAXINFER_V16_OP(*)
JAXINFER_V16_OP(/)
#undef JAXINFER_V16_OP

inline v16 load16(const float* p) {
  return {*reinterpret_cast<const v8u*>(p), *reinterpret_cast<const v8u*>(p + 8)};
}

inline void store16(float* p, v16 v) {
  *reinterpret_cast<v8u*>(p) = v.lo;
  *reinterpret_cast<v8u*>(p + 8) = v.hi;
}

inline v16 join(__m256 lo, __m256 hi) {
  return {reinterpret_cast<v8>(lo), reinterpret_cast<v8>(hi)};
}

// What the attention kernel does beyond arithmetic: lane masks from comparisons, selects,
// float <-> int32 conversions, 32-bit integer lanes, a sum across lanes.
typedef int32_t v8i __attribute__((vector_size(32)));

struct v16i {
  v8i lo, hi;
};

inline v16i operator+(v16i a, int32_t b) { return {a.lo + b, a.hi + b}; }

inline v16i operator<<(v16i a, int b) { return {a.lo << b, a.hi << b}; }

struct m16 {  // lanes all ones (true) or zero, as a vector comparison gives
  v8i lo, hi;
};

inline m16 operator&(m16 a, m16 b) { return {a.lo & b.lo, a.hi & b.hi}; }

#define JAXINFER_V16_CMP(OP)                                                          \
  inline m16 operator OP(v16 a, v16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; }       \
  inline m16 operator OP(v16 a, float b) { return {a.lo OP b, a.hi OP b}; }           \
  inline m16 operator OP(float a, v16 b) { return {a OP b.lo, a OP b.hi}; }
JAXINFER_V16_CMP(<)
JAXINFER_V16_CMP(>)
JAXINFER_V16_CMP(<=)
JAXINFER_V16_CMP(>=)
#undef JAXINFER_V16_CMP

inline v16 select(m16 m, v16 a, v16 b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }

inline v16i to_int(v16 v) {
  return {__builtin_convertvector(v.lo, v8i), __builtin_convertvector(v.hi, v8i)};
}

inline v16 to_float(v16i v) {
  return {__builtin_convertvector(v.lo, v8), __builtin_convertvector(v.hi, v8)};
}

inline float hsum(v16 v) {
  const v8 s = v.lo + v.hi;
  float t = 0.0f;
  for (int i = 0; i < 8; ++i) t += s[i];  // (reassociated into shuffles: -ffast-math)
  return t;
}
#else
typedef gv16 v16;
typedef int32_t v16i __attribute__((vector_size(64)));
typedef v16i m16;

inline v16 load16(const float* p) { return gload16(p); }

inline void store16(float* p, v16 v) { gstore16(p, v); }

inline v16 select(m16 m, v16 a, v16 b) { return m ? a : b; }

inline v16i to_int(v16 v) { return __builtin_convertvector(v, v16i); }

inline v16 to_float(v16i v) { return __builtin_convertvector(v, v16); }

inline float hsum(v16 v) {
  float t = 0.0f;
  for (int i = 0; i < 16; ++i) t += v[i];  // (reassociated into shuffles: -ffast-math)
  return t;
}
#endif

#if defined(__AVX2__)

#if defined(__AVX512F__)
// With AVX-512 the 16 lanes widen in one instruction each (the AVX2 form's halves, shifts
// and joins: 8 shuffle-port uops per k row of an int8 panel, where this needs 2).
inline v16 i8_to_float16x(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
}

// 16 bfloat16 values -> floats: each one's 16 bits become a float's high half (exact).
inline v16 bf16_to_float16x(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
inline v16 i8_to_float16x(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}

inline v16 bf16_to_float16x(const uint16_t* p) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return join(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
              _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
}
#endif

// 8 fp8 bytes (their 32-bit lanes) -> 8 floats. Normal numbers move their exponent and
// mantissa into float32's fields with the exponent bias raised (e4m3 "fn": bias 7, 3 mantissa
// bits; e5m2: bias 15, 2 bits); subnormals (exponent 0) are mantissa * 2^(1 - bias - mantissa
// bits), an integer conversion (no float32 subnormals, so flush-to-zero changes nothing).
// NaN / infinity patterns never occur: writers saturate to the finite range.
template <int kMantBits, int kBias>
inline __m256 fp8x8_to_float(__m256i b) {
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - kMantBits),
                                          _mm256_set1_epi32((127 - kBias) << 23));
  constexpr float kSub = 1.0f / float(1u << (kBias - 1 + kMantBits));
  const __m256 sub = _mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_and_si256(mag, _mm256_set1_epi32((1 << kMantBits) - 1))),
      _mm256_set1_ps(kSub));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << kMantBits), mag);
  const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub,
                                    _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(r, _mm256_castsi256_ps(sign));
}

#if defined(__AVX512F__)
// (the same, 16 lanes at a time)
template <int kMantBits, int kBias>
inline v16 fp8_to_float16x(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - kMantBits),
                                          _mm512_set1_epi32((127 - kBias) << 23));
  constexpr float kSub = 1.0f / float(1u << (kBias - 1 + kMantBits));
  const __m512 sub = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_and_si512(mag, _mm512_set1_epi32((1 << kMantBits) - 1))),
      _mm512_set1_ps(kSub));
  const __mmask16 is_sub = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(1 << kMantBits), mag);
  const __m512 r = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return reinterpret_cast<v16>(_mm512_or_si512(_mm512_castps_si512(r), sign));
}
#else
template <int kMantBits, int kBias>
inline v16 fp8_to_float16x(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return join(fp8x8_to_float<kMantBits, kBias>(_mm256_cvtepu8_epi32(b)),
              fp8x8_to_float<kMantBits, kBias>(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
#endif
#else
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1), may_alias));
typedef int8_t v16s8 __attribute__((vector_size(16), aligned(1), may_alias));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16 i8_to_float16x(const int8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const v16s8*>(p), v16);
}

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2), may_alias));

inline v16 bf16_to_float16x(const uint16_t* p) {
  const v16u32 bits = __builtin_convertvector(*reinterpret_cast<const v16u16*>(p), v16u32)
                      << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// (as the AVX2 form above, with GCC's generic vectors)
template <int kMantBits, int kBias>
inline v16 fp8_to_float16x(const uint8_t* p) {
  const v16u32 b = __builtin_convertvector(*reinterpret_cast<const v16u8*>(p), v16u32);
  const v16u32 mag = b & 0x7Fu;
  const v16u32 normal_bits = (mag << (23 - kMantBits)) + (uint32_t(127 - kBias) << 23);
  v16 normal;
  std::memcpy(&normal, &normal_bits, sizeof normal);
  constexpr float kSub = 1.0f / float(1u << (kBias - 1 + kMantBits));
  const v16 sub = __builtin_convertvector(mag & ((1u << kMantBits) - 1u), v16) * kSub;
  const v16 r = mag < (1u << kMantBits) ? sub : normal;
  v16u32 bits;
  std::memcpy(&bits, &r, sizeof bits);
  bits |= (b & 0x80u) << 24;
  v16 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
#endif

inline v16 e4m3_to_float16x(const uint8_t* p) { return fp8_to_float16x<3, 7>(p); }
inline v16 e5m2_to_float16x(const uint8_t* p) { return fp8_to_float16x<2, 15>(p); }

// A prefetch the compiler must keep: GCC 12 drops __builtin_prefetch calls in loops it finds
// have no other effect (the kernel's first prefetching loop compiled to nothing). The address
// goes in as a register, not a memory operand: with one, GCC took the asm for a read of any
// memory and stored every live sum to the stack before each prefetch (one store per FMA in
// the streaming blocks' loops).
inline void prefetch(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p);
#endif
}

// Into L2 (prefetcht1): lines needed a while later, kept out of L1 (the builtin: only used in
// loops with other work, where GCC keeps it).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even (NaN kept a NaN). Branch-free, so that loops of it vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t nan = (bits >> 16) | 0x40u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// CPUs this process may run on (its affinity mask), at least 1.
inline int64_t usable_cpus() {
  static const int64_t n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return int64_t{1};
    return std::max<int64_t>(1, CPU_COUNT(&set));
  }();
  return n;
}

// Helper tasks to schedule beside the calling thread, which works too: one fewer than the
// CPUs, and no more than the pool's threads or the work items past the caller's first. The
// caller may or may not be one of the pool's threads (XLA runs a program on the thread that
// dispatched it, or on one of its own); asking for a helper per pool thread on top of the
// caller put three busy threads on two cores whenever it was not, and the caller's final wait
// then took CPU from the helper still finishing (benchmarks/step_cost.py: layer-wise steps
// lost ~15% to it).
inline int64_t helper_count(int64_t pool_threads, int64_t items) {
  return std::max<int64_t>(0, std::min({pool_threads, usable_cpus() - 1, items - 1}));
}

// fn(c) for every chunk c in [0, chunks), the calling thread and helper tasks from `pool`
// (XLA's ffi::ThreadPool) claiming chunks in turn; returns once every chunk is done. A helper
// that starts after the others took every chunk calls nothing.
template <typename Pool, typename F>
void run_chunks(Pool& pool, int64_t chunks, F fn) {
  struct Claims {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto claims = std::make_shared<Claims>();
  auto run = [claims, chunks, &fn] {
    for (int64_t c; (c = claims->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      fn(c);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers =
      helper_count(std::max<int64_t>(1, static_cast<int64_t>(pool.num_threads())), chunks);
  // (a helper keeps the claims alive; it touches fn only for a chunk it claimed, and every
  // claimed chunk is done before this returns)
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  while (claims->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// fn(m0, m1) over rows [0, M) of `width` values each: by the calling thread alone where the
// rows hold few values (serial_values or fewer: 2^16 suits a pass of a few operations per
// value), else in chunks of rows of ~serial_values / 4 values (run_chunks).
template <typename Pool, typename F>
void run_rows(Pool& pool, int64_t M, int64_t width, F fn,
              int64_t serial_values = int64_t{1} << 16) {
  if (M * width <= serial_values) {
    fn(int64_t{0}, M);
    return;
  }
  const int64_t rows = std::max<int64_t>(1, serial_values / (4 * width));
  run_chunks(pool, (M + rows - 1) / rows,
             [&](int64_t c) { fn(c * rows, std::min(M, (c + 1) * rows)); });
}

}  // namespace jaxinfer_cpu
