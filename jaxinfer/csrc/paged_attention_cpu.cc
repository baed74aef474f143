// Ragged paged attention for CPUs, an XLA FFI custom call (the "cpu" attention backend).
//
// Same contract as pallas_kernels.reference.ragged_paged_attention_reference: a flat batch of
// T query tokens of R sequences (query_start_loc), causal attention over each sequence's paged
// KV cache (block_tables, kv_lens), optional sliding window; rows past the real tokens are 0.
//
// Why: XLA's CPU formulation gathers pages into fresh buffers and runs many tiny batched dots;
// this reads each page in place and does only the math. Work items are (sequence, KV head,
// tile of up to kTile query tokens); every query head of the item's group shares each K/V row
// read. Items are shared out over XLA's intra-op thread pool: the calling thread works too and
// waits only for items already claimed, so it never waits on a queued task.
//
// Every index read from the device is checked (sequence count, query offsets, lengths, block
// ids): a bad value returns an error to the step instead of reading out of bounds.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_cpu::hsum;
using jaxinfer_cpu::load16;
using jaxinfer_cpu::select;
using jaxinfer_cpu::store16;
using jaxinfer_cpu::to_float;
using jaxinfer_cpu::to_int;
using jaxinfer_cpu::v16;
using jaxinfer_cpu::v16i;

constexpr int64_t kTile = 16;  // query tokens per work item
// The running max's start: finite (the kernel is built with -ffast-math, which assumes no
// infinities), and exp(it - any real score) is exactly 0.
constexpr float kMaskValue = -1e30f;
constexpr int64_t kRB = 6;  // query rows per register block (blocked P.V)
constexpr int64_t kBlockedMinRows = 8;  // items with fewer rows take per-row dots
constexpr int64_t kAheadKeys = 8;  // how far ahead decode items prefetch their keys into L1
constexpr int64_t kFarKeys = 48;  // and into L2 (Zen 4: 16 and 32 slower than 24; Zen 5: 48 faster)
// The L2 lead for 2-byte (bf16, f16) caches: a row is half as long, and on a Zen 5 VM
// (2026-11-30, benchmarks/cpu_attention.py paired, both ways round) bf16 decode attention took
// 0.93 of the time at 32 x 256 and 0.98 at 8 x 1024 with 16 keys instead of 48 (24: 0.97 of
// 48's; 12 and 16 about level; 96 slower; no L2 prefetch 1.1-1.15x). float32 keeps 48 (16 was
// level with 24 there, and slower than 24 on Zen 4).
constexpr int64_t kFarKeys2 = 16;
constexpr int64_t kPvKeys = 16;  // keys per register-held P.V block of a decode item
// Split decode items (few sequences): each covers at least this many keys of its sequence.
constexpr int64_t kMinSplitKeys = 64;

using jaxinfer_cpu::bf16_to_float;
using jaxinfer_cpu::float_to_bf16;

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t sign = (bits >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t man = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into exp: right
  return static_cast<uint16_t>(half);
}

// fp8 KV caches (kv_cache_dtype "fp8" / "fp8_e5m2"): e4m3 "fn" (bias 7, no infinities) and
// e5m2 (float16's top byte). (Their per-tensor scales are applied outside: q times k_scale
// going in, the output times v_scale coming out.)
inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  float x;
  if (mag < 8u) {
    x = static_cast<float>(mag) * 0x1p-9f;  // subnormal: mantissa * 2^-9
  } else {
    const uint32_t bits = (mag << 20) + (120u << 23);
    std::memcpy(&x, &bits, sizeof x);
  }
  return (b & 0x80u) ? -x : x;
}

enum class Kind { kF32, kBF16, kF16, kF8E4M3, kF8E5M2 };

inline float load(const void* base, int64_t i, Kind kind) {
  switch (kind) {
    case Kind::kF32: return static_cast<const float*>(base)[i];
    case Kind::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case Kind::kF8E4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case Kind::kF8E5M2:
      return half_to_float(static_cast<uint16_t>(static_cast<const uint8_t*>(base)[i]) << 8);
    default: return half_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

inline void store(void* base, int64_t i, float x, Kind kind) {
  switch (kind) {
    case Kind::kF32: static_cast<float*>(base)[i] = x; break;
    case Kind::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: static_cast<uint16_t*>(base)[i] = float_to_half(x); break;
  }
}

struct Problem {
  const void* q;  // [T, Hq, D]
  const void* k;  // [NB, BS, Hkv, D]
  const void* v;
  void* out;  // [T, Hq, D]
  Kind q_kind, kv_kind;
  const int32_t* kv_lens;  // [R]
  const int32_t* tables;  // [R, MB]
  const int32_t* qsl;  // [R+1]
  int64_t T, Hq, Hkv, D, NB, BS, R, MB, group, window;
  float scale;
  const float* sinks;  // [Hq] attention sinks (gpt-oss), or nullptr
  float* parts = nullptr;  // split decode items' partial results, part_stride floats each
  int64_t part_stride = 0;
};

// Query row q[src, src + n) times s, as floats, into dst: float32 and bf16 rows in loops that
// vectorize (a bf16 model's prefill items had spent about as long on a per-value switch here
// and in store_row as on their scores).
inline void load_row(const Problem& p, int64_t src, float s, int64_t n, float* dst) {
  if (p.q_kind == Kind::kF32) {
    const float* q = static_cast<const float*>(p.q) + src;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = q[d] * s;
  } else if (p.q_kind == Kind::kBF16) {
    const uint16_t* q = static_cast<const uint16_t*>(p.q) + src;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(q[d]) * s;
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = load(p.q, src + d, p.q_kind) * s;
  }
}

// Output row out[dst, dst + n) = src[0, n) times s, in the output's dtype (bf16: rounded to
// nearest even).
inline void store_row(const Problem& p, int64_t dst, const float* src, float s, int64_t n) {
  if (p.q_kind == Kind::kF32) {
    float* o = static_cast<float*>(p.out) + dst;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) o[d] = src[d] * s;
  } else if (p.q_kind == Kind::kBF16) {
    uint16_t* o = static_cast<uint16_t*>(p.out) + dst;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) o[d] = float_to_bf16(src[d] * s);
  } else {
    for (int64_t d = 0; d < n; ++d) store(p.out, dst + d, src[d] * s, p.q_kind);
  }
}

// 1 / a row's softmax denominator: its running sum l over the keys, plus e^(sink - m) for an
// attention sink (a logit with no value); 0 for a row that saw no key.
inline float inv_denominator(const Problem& p, int64_t q_head, float m, float l) {
  if (p.sinks != nullptr) l += std::exp(p.sinks[q_head] - m);
  return l > 0.0f && l <= std::numeric_limits<float>::max() ? 1.0f / l : 0.0f;
}

struct Item {
  int32_t seq, head, tile;  // (a decode item: every KV head; `head` is 0)
  bool decode;  // run_decode_item (all heads, f32 / bf16 / fp8 KV, D % 16 == 0), else run_item
  // A split decode item: only keys [k0, k1) of its tile's span, its running max, sum and
  // unnormalized output left in p.parts slot `part` for combine_parts (-1: not split).
  int32_t part = -1, k0 = 0, k1 = 0;
};

// An item's query tokens [start + r0, start + r1) of its sequence, the sequence's context
// before this step (ctx) and the KV positions the tile sees, [lo, hi) (causal, window).
struct Span {
  int64_t start, ctx, r0, r1, lo, hi;
};

inline Span span_of(const Problem& p, const Item& it) {
  Span sp;
  sp.start = p.qsl[it.seq];
  const int64_t q_len = p.qsl[it.seq + 1] - sp.start, kv_len = p.kv_lens[it.seq];
  sp.ctx = kv_len - q_len;
  sp.r0 = it.tile * kTile;
  sp.r1 = std::min(q_len, sp.r0 + kTile);
  sp.hi = std::min(kv_len, sp.ctx + sp.r1);
  sp.lo = p.window > 0 ? std::max<int64_t>(0, sp.ctx + sp.r0 - p.window + 1) : 0;
  return sp;
}

// One page's share of a walk over a sequence's KV positions [lo, hi): positions [j0, j0 + n)
// of page `page`, the first of them in cache slot `slot` (its block * BS + the offset).
struct PageSpan {
  int64_t page, j0, n, slot;
};

// fn(PageSpan) for each page of sequence `seq` holding positions of [lo, hi), in order; false
// (fn not called for it) at a block id outside [0, NB).
template <typename Fn>
inline bool for_each_page(const Problem& p, int64_t seq, int64_t lo, int64_t hi, Fn&& fn) {
  const int32_t* table = p.tables + seq * p.MB;
  const int64_t BS = p.BS;
  for (int64_t page = lo / BS; page * BS < hi; ++page) {
    const int64_t blk = table[page];
    if (blk < 0 || blk >= p.NB) return false;
    const int64_t j0 = std::max(lo, page * BS), j1 = std::min(hi, (page + 1) * BS);
    fn(PageSpan{page, j0, j1 - j0, blk * BS + (j0 - page * BS)});
  }
  return true;
}

// The K and V rows of n keys of one KV head from cache slot `slot` on (one page): in place
// for float32 caches (D floats each, stride Hkv * D), else converted into kbuf / vbuf [n, D].
struct PageRows {
  const float* k;
  const float* v;
  int64_t stride;
};

inline PageRows page_rows(const Problem& p, int64_t head, int64_t slot, int64_t n, float* kbuf,
                          float* vbuf) {
  const int64_t D = p.D, stride = p.Hkv * D, base = (slot * p.Hkv + head) * D;
  if (p.kv_kind == Kind::kF32)
    return {static_cast<const float*>(p.k) + base, static_cast<const float*>(p.v) + base, stride};
  if (D % 16 == 0 && p.kv_kind != Kind::kF16) {  // 16 at a time (the scalar loop below, one
    // value per switch, was a third of a bf16 model's prefill attention)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; d += 16) {
        const int64_t at = base + j * stride + d;
        v16 kx, vx;
        if (p.kv_kind == Kind::kBF16) {
          kx = jaxinfer_cpu::bf16_to_float16x(static_cast<const uint16_t*>(p.k) + at);
          vx = jaxinfer_cpu::bf16_to_float16x(static_cast<const uint16_t*>(p.v) + at);
        } else if (p.kv_kind == Kind::kF8E4M3) {
          kx = jaxinfer_cpu::e4m3_to_float16x(static_cast<const uint8_t*>(p.k) + at);
          vx = jaxinfer_cpu::e4m3_to_float16x(static_cast<const uint8_t*>(p.v) + at);
        } else {
          kx = jaxinfer_cpu::e5m2_to_float16x(static_cast<const uint8_t*>(p.k) + at);
          vx = jaxinfer_cpu::e5m2_to_float16x(static_cast<const uint8_t*>(p.v) + at);
        }
        store16(kbuf + j * D + d, kx);
        store16(vbuf + j * D + d, vx);
      }
    return {kbuf, vbuf, D};
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      kbuf[j * D + d] = load(p.k, base + j * stride + d, p.kv_kind);
      vbuf[j * D + d] = load(p.v, base + j * stride + d, p.kv_kind);
    }
  return {kbuf, vbuf, D};
}

#if defined(__AVX512F__)
// exp16 (below) in fewer instructions where AVX-512 has them: the exponent rounded in one
// vrndscaleps and applied by vscalefps (no integer conversions and shifts); the same
// reduction and polynomial, so the same accuracy.
inline __m512 exp16_scalef(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r, _mm512_set1_ps(1.0f / 720.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}
#endif

// e^x for x <= 0, 16 lanes (relative error under 1.2e-7 down to -20, 3e-7 to -87): x = n ln2
// + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7, times 2^n built in the exponent bits.
// Below -87 (results under float32's normal range) the result is ~1e-38, not 0: callers zero
// masked entries themselves.
inline v16 exp16(v16 x) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(exp16_scalef(reinterpret_cast<__m512>(x)));
#else
  x = select(x < -87.0f, v16{} - 87.0f, x);
  const v16 t = x * 1.44269504f;
  const v16i n = to_int(t + select(t < 0.0f, v16{} - 0.5f, v16{} + 0.5f));
  const v16 nf = to_float(n);
  const v16 r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;  // ln 2, in two parts
  v16 e = 1.0f / 5040.0f + r * 0.0f;
  e = e * r + 1.0f / 720.0f;
  e = e * r + 1.0f / 120.0f;
  e = e * r + 1.0f / 24.0f;
  e = e * r + 1.0f / 6.0f;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
#endif
}

constexpr int64_t kKeys = 8;  // keys per register block of blocked scores

// Scores of 16 * NV rows (query vectors qt [D, RP] from row 16 * rv0, transposed) x kKeys
// keys (rows of the page, k[i] each): st[key, row] (transposed: softmax then runs along
// rows, 16 at a time). Each d broadcasts one value of each key against NV vectors of rows.
template <int NV>
inline void scores_block(const float* qt, int64_t RP, const float* const* k, int64_t D,
                         float* st) {
  v16 acc[NV][kKeys];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = v16{};
  for (int64_t d = 0; d < D; ++d) {
    v16 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load16(qt + d * RP + 16 * v);
    for (int j = 0; j < kKeys; ++j) {
      const float kd = k[j][d];
      for (int v = 0; v < NV; ++v) acc[v][j] += q[v] * kd;
    }
  }
  for (int j = 0; j < kKeys; ++j)
    for (int v = 0; v < NV; ++v) store16(st + j * RP + 16 * v, acc[v][j]);
}

// acc rows [0, nr) (nr <= kRB; row stride D), 16 * NV columns, += the weights w [n keys,
// stride RP] of kRB rows x V's n rows (stride vs): each V load feeds kRB rows' FMAs. Rows
// past nr accumulate whatever w holds there and are not stored.
template <int NV>
inline void pv_block(const float* w, int64_t RP, const float* v, int64_t vs, int64_t n,
                     float* acc, int64_t D, int64_t nr) {
  v16 o[kRB][NV];
  for (int64_t i = 0; i < kRB; ++i)
    for (int c = 0; c < NV; ++c) o[i][c] = i < nr ? load16(acc + i * D + 16 * c) : v16{};
  for (int64_t j = 0; j < n; ++j) {
    v16 vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = load16(v + j * vs + 16 * c);
    for (int64_t i = 0; i < kRB; ++i) {
      const float wi = w[j * RP + i];
      for (int c = 0; c < NV; ++c) o[i][c] += wi * vj[c];
    }
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int c = 0; c < NV; ++c) store16(acc + i * D + 16 * c, o[i][c]);
}

// The online softmax of one page's scores st [n keys, RP rows] (transposed), 16 rows at a
// time: probabilities (0 where a key is not visible to a row: causal, window, from pos and
// first) replace the scores; each row's running max m and sum l are updated and its acc row
// [D] rescaled. Pages every row sees whole (before the tile's first token, no window) need
// no masks (masked false).
inline void softmax_page(float* st, int64_t RP, int64_t RV, int64_t rows, int64_t n, int64_t j0,
                         bool masked, const float* pos, const float* first, float* m, float* l,
                         float* acc, int64_t D) {
  for (int64_t rv = 0; rv < RV; ++rv) {
    const v16 last = load16(pos + 16 * rv), from = load16(first + 16 * rv);
    const v16 m_old = load16(m + 16 * rv);
    v16 mx = m_old;
    for (int64_t j = 0; j < n; ++j) {
      float* sj = st + j * RP + 16 * rv;
      v16 sc = load16(sj);
      if (masked) {
        const float key = static_cast<float>(j0 + j);
        sc = select((key <= last) & (key >= from), sc, v16{} + kMaskValue);
        store16(sj, sc);
      }
      mx = select(mx > sc, mx, sc);
    }
    v16 sum = v16{};
    for (int64_t j = 0; j < n; ++j) {
      float* sj = st + j * RP + 16 * rv;
      const v16 sc = load16(sj);
      const v16 e = masked ? select(sc > kMaskValue, exp16(sc - mx), v16{}) : exp16(sc - mx);
      store16(sj, e);
      sum += e;
    }
    const v16 corr = exp16(m_old - mx);  // 1 while a row has seen no key (acc is 0)
    store16(l + 16 * rv, load16(l + 16 * rv) * corr + sum);
    store16(m + 16 * rv, mx);
    for (int64_t i = 0; i < 16 && 16 * rv + i < rows; ++i) {
      float* ar = acc + (16 * rv + i) * D;
      for (int64_t d = 0; d < D; d += 16) store16(ar + d, load16(ar + d) * corr[i]);
    }
  }
}

// A prefill tile's RP rows before its pages: each row's position (its last visible key) and
// first visible key (the window) as floats, its running max and sum reset. Padding rows
// (past `rows`: zero queries, finite scores, never stored) see every key.
inline void start_tile_rows(const Problem& p, int64_t ctx, int64_t r0, int64_t rows, int64_t RP,
                            float* pos, float* first, float* m, float* l) {
  for (int64_t row = 0; row < RP; ++row) {
    const int64_t t = r0 + row / p.group;
    pos[row] = row < rows ? static_cast<float>(ctx + t) : 3e38f;
    first[row] = row < rows && p.window > 0 ? static_cast<float>(ctx + t - p.window + 1) : 0.0f;
    m[row] = kMaskValue;
    l[row] = 0.0f;
  }
}

// A prefill tile's output rows: acc [rows, D] over each row's softmax denominator, into out.
inline void store_tile_rows(const Problem& p, const Item& it, int64_t start, int64_t r0,
                            int64_t rows, const float* acc, const float* m, const float* l) {
  const int64_t D = p.D, G = p.group;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = r0 + row / G;
    const int64_t dst = ((start + t) * p.Hq + it.head * G + row % G) * D;
    store_row(p, dst, acc + row * D, inv_denominator(p, it.head * G + row % G, m[row], l[row]),
              D);
  }
}

// Every cache line of an item's query rows, tokens [r0, r1) of its KV head's group, into L1
// before they are read: a row at a time, the first reads of the rows (an earlier program's
// output, often in the other core's cache) stalled in turn, ~19% of a float32 2 x 1024
// prefill's attention timed alone (benchmarks/cpu_attention.py; ~8% left with this).
inline void prefetch_q_rows(const Problem& p, int64_t start, int64_t r0, int64_t r1,
                            int64_t head) {
  const int64_t elem = p.q_kind == Kind::kF32 ? 4 : 2, bytes = p.group * p.D * elem;
  const char* q = static_cast<const char*>(p.q);
  for (int64_t t = r0; t < r1; ++t) {
    const char* row = q + ((start + t) * p.Hq + head * p.group) * p.D * elem;
    for (int64_t b = 0; b < bytes; b += 64) jaxinfer_cpu::prefetch(row + b);
  }
}

// Prefill-shaped items (kBlockedMinRows rows or more, D a multiple of 16): per page, the
// scores of all the item's rows come out transposed, [key, row], kKeys keys x up to 48 rows
// per register block, the queries transposed once per item (no per-page transpose of K); the
// online softmax runs down the keys 16 rows at a time (vector exp, masks for causality and the
// window), then P.V takes kRB rows x 64 output columns per register block over the page's V
// rows. Returns false on an out-of-range block id.
bool run_blocked_item(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t D = p.D, G = p.group, BS = p.BS;
  const Span sp = span_of(p, it);
  const int64_t start = sp.start, ctx = sp.ctx, r0 = sp.r0, r1 = sp.r1, lo = sp.lo, hi = sp.hi;
  const int64_t rows = (r1 - r0) * G;  // (query token, head in group) pairs
  const int64_t RP = (rows + 15) / 16 * 16, RV = RP / 16;
  const int64_t BSP = (BS + kKeys - 1) / kKeys * kKeys;
  // scratch: qt [D, RP] | st [BSP + 1, RP] | acc [rows, D] | m, l, pos, first [RP] |
  // k, v [BS, D] (st's extra row: P.V's last register block reads past the rows)
  scratch.resize(static_cast<size_t>(D * RP + (BSP + 1) * RP + rows * D + 4 * RP + 2 * BS * D));
  float* qt = scratch.data();
  float* st = qt + D * RP;
  float* acc = st + (BSP + 1) * RP;
  float* m = acc + rows * D;
  float* l = m + RP;
  float* pos = l + RP;
  float* first = pos + RP;
  float* kbuf = first + RP;
  float* vbuf = kbuf + BS * D;
  prefetch_q_rows(p, start, r0, r1, it.head);
  start_tile_rows(p, ctx, r0, rows, RP, pos, first, m, l);
  std::fill(qt, qt + D * RP, 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = r0 + row / G;
    load_row(p, ((start + t) * p.Hq + it.head * G + row % G) * D, p.scale, D, kbuf);
    for (int64_t d = 0; d < D; ++d) qt[d * RP + row] = kbuf[d];  // (kbuf: free until pages)
  }
  std::fill(acc, acc + rows * D, 0.0f);
  const bool ok = for_each_page(p, it.seq, lo, hi, [&](const PageSpan& pg) {
    const int64_t j0 = pg.j0, n = pg.n, j1 = j0 + n;
    const PageRows pr = page_rows(p, it.head, pg.slot, n, kbuf, vbuf);
    const float* kp = pr.k;
    const float* vp = pr.v;
    const int64_t kstride = pr.stride;
    // Scores [n, RP] (keys past n repeat the last one; their scores are never read).
    for (int64_t c = 0; c < n; c += kKeys) {
      const float* k[kKeys];
      for (int64_t j = 0; j < kKeys; ++j) k[j] = kp + std::min(c + j, n - 1) * kstride;
      for (int64_t rv = 0; rv < RV; rv += 3) {
        float* out = st + c * RP + 16 * rv;
        switch (std::min<int64_t>(3, RV - rv)) {
          case 1: scores_block<1>(qt + 16 * rv, RP, k, D, out); break;
          case 2: scores_block<2>(qt + 16 * rv, RP, k, D, out); break;
          default: scores_block<3>(qt + 16 * rv, RP, k, D, out); break;
        }
      }
    }
    softmax_page(st, RP, RV, rows, n, j0, p.window > 0 || j1 - 1 > ctx + r0, pos, first, m, l,
                 acc, D);
    // P.V: kRB rows x up to 64 output columns per register block, over the page's V rows.
    for (int64_t r = 0; r < rows; r += kRB) {
      const int64_t nr = std::min(kRB, rows - r);
      for (int64_t d = 0; d < D; d += 64) {
        float* a = acc + r * D + d;
        switch (std::min<int64_t>(4, (D - d) / 16)) {
          case 1: pv_block<1>(st + r, RP, vp + d, kstride, n, a, D, nr); break;
          case 2: pv_block<2>(st + r, RP, vp + d, kstride, n, a, D, nr); break;
          case 3: pv_block<3>(st + r, RP, vp + d, kstride, n, a, D, nr); break;
          default: pv_block<4>(st + r, RP, vp + d, kstride, n, a, D, nr); break;
        }
      }
    }
  });
  if (!ok) return false;
  store_tile_rows(p, it, start, r0, rows, acc, m, l);
  return true;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
bool run_blocked_item_bf16(const Problem& p, const Item& it, std::vector<float>& scratch);
#endif

// Online-softmax attention of one item; returns false on an out-of-range block id.
bool run_item(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t D = p.D, G = p.group, BS = p.BS;
  const Span sp = span_of(p, it);
  const int64_t start = sp.start, ctx = sp.ctx, r0 = sp.r0, r1 = sp.r1, lo = sp.lo, hi = sp.hi;
  const int64_t rows = (r1 - r0) * G;  // (query token, head in group) pairs
  if (rows >= kBlockedMinRows && D % 16 == 0) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (D % 32 == 0 && p.q_kind == Kind::kBF16 && p.kv_kind == Kind::kBF16)
      return run_blocked_item_bf16(p, it, scratch);
#endif
    return run_blocked_item(p, it, scratch);
  }
  // A few rows (or D not a multiple of 16): a dot product per (row, key).
  // scratch: q [rows, D] | acc [rows, D] | m, l [rows] | scores [rows, BS] | k, v page [BS, D]
  scratch.resize(static_cast<size_t>(2 * rows * D + 2 * rows + rows * BS + 2 * BS * D));
  float* qf = scratch.data();
  float* acc = qf + rows * D;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* s = l + rows;
  float* kbuf = s + rows * BS;
  float* vbuf = kbuf + BS * D;
  const bool vec_d = D % 16 == 0;
  for (int64_t t = r0; t < r1; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = (t - r0) * G + g;
      load_row(p, ((start + t) * p.Hq + it.head * G + g) * D, p.scale, D, qf + row * D);
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, kMaskValue);
  std::fill(l, l + rows, 0.0f);
  // KV positions this tile sees: [lo, hi)
  const bool ok = for_each_page(p, it.seq, lo, hi, [&](const PageSpan& pg) {
    const int64_t j0 = pg.j0, n = pg.n;
    const PageRows pr = page_rows(p, it.head, pg.slot, n, kbuf, vbuf);
    const float* kp = pr.k;
    const float* vp = pr.v;
    const int64_t kstride = pr.stride;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t pos = ctx + r0 + row / G;  // this query token's position
      // Positions [j0 + a, j0 + b) of this page are visible to this row (causal, window).
      const int64_t a = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - j0) : 0;
      const int64_t b = std::min<int64_t>(n, pos + 1 - j0);
      if (a >= b) continue;
      float* sr = s + row * BS;
      const float* qr = qf + row * D;
      float mx = m[row];
      for (int64_t j = a; j < b; ++j) {
        const float* kr = kp + j * kstride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
        sr[j] = dot;
        mx = std::max(mx, dot);
      }
      const float corr = std::exp(m[row] - mx);  // 0 on the row's first page
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = a; j < b; ++j) {  // vectorised exp (libmvec)
        sr[j] = std::exp(sr[j] - mx);
        sum += sr[j];
      }
      float* ar = acc + row * D;
      if (vec_d) {  // each 16-wide slice of the output stays in a register over keys
        for (int64_t d = 0; d < D; d += 16) {
          v16 av = load16(ar + d) * corr;
          for (int64_t j = a; j < b; ++j) av += sr[j] * load16(vp + j * kstride + d);
          store16(ar + d, av);
        }
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
        for (int64_t j = a; j < b; ++j) {
          const float e = sr[j];
          const float* vr = vp + j * kstride;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += e * vr[d];
        }
      }
      l[row] = l[row] * corr + sum;
      m[row] = mx;
    }
  });
  if (!ok) return false;
  for (int64_t t = r0; t < r1; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = (t - r0) * G + g;
      const int64_t dst = ((start + t) * p.Hq + it.head * G + g) * D;
      store_row(p, dst, acc + row * D, inv_denominator(p, it.head * G + g, m[row], l[row]), D);
    }
  }
  return true;
}

// Lane t of sum16(p) = the sum of p[kBitReversed[t]]'s lanes: four levels, each adding two
// vectors' halves (two shuffles and an add per pair), the last leaving the 16 sums in bit-
// reversed order; storing key t's partial products at kBitReversed[t] puts them in order.
constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

#if defined(JAXINFER_V16_PAIR)
// Lane t of sum8(p) = the sum of p[kBitReversed8[t]]'s lanes (three levels, as sum16's last).
constexpr int kBitReversed8[8] = {0, 4, 2, 6, 1, 5, 3, 7};

inline jaxinfer_cpu::v8 sum8(jaxinfer_cpu::v8 (&p)[8]) {
  for (int i = 0; i < 4; ++i)
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(p[0], p[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(p[0], p[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

#else
inline v16 sum16(v16 (&p)[16]) {
  for (int i = 0; i < 8; ++i)
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(p[0], p[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(p[0], p[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}
#endif

// Decode-shaped items (a few query tokens of one sequence, every KV head; a float32, bf16 or
// fp8 cache, D a multiple of 16): each page is read key by key, a key's K (then V) rows of all heads being one
// contiguous run, so each page streams through the hardware prefetcher instead of arriving as
// head-strided pieces (decode attention is bound by these bytes: per-head reads ran at ~12 GB/s
// of this machine's ~31). The accumulators live in L1. Returns false on a bad block id.
// Cache entries as floats, 16 at a time: float32, or bf16 / fp8 (e4m3 "fn" / e5m2) widened.
struct BF16 {
  uint16_t b;
};
struct E4M3 {
  uint8_t b;
};
struct E5M2 {
  uint8_t b;
};
inline v16 kv16(const float* p) { return load16(p); }
inline v16 kv16(const BF16* p) { return jaxinfer_cpu::bf16_to_float16x(&p->b); }
inline v16 kv16(const E4M3* p) { return jaxinfer_cpu::e4m3_to_float16x(&p->b); }
inline v16 kv16(const E5M2* p) { return jaxinfer_cpu::e5m2_to_float16x(&p->b); }

#if !defined(JAXINFER_V16_PAIR)
// P.V of R rows (row r: probabilities pr[r][0..n), output acc[r][0..16 C)) over n keys' V
// rows (v, stride apart; 16 C values each): the outputs stay in registers over the keys and
// each V row is loaded (widened) once for all R rows.
template <int R, int C, typename KV>
inline void pv_regs(const float* const* pr, float* const* acc, const KV* v, int64_t stride,
                    int64_t n) {
  v16 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load16(acc[r] + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    v16 x[C];
    for (int c = 0; c < C; ++c) x[c] = kv16(v + t * stride + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float e = pr[r][t];
      for (int c = 0; c < C; ++c) a[r][c] += e * x[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(acc[r] + 16 * c, a[r][c]);
}

// pv_regs over all D values (D % 16 == 0), 64 at a time, for R <= kRB rows.
template <int R, typename KV>
inline void pv_rows_d(const float* const* pr, float* const* acc, const KV* v, int64_t stride,
                      int64_t n, int64_t D) {
  float* a[R];
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    for (int r = 0; r < R; ++r) a[r] = acc[r] + d;
    pv_regs<R, 4>(pr, a, v + d, stride, n);
  }
  for (; d < D; d += 16) {
    for (int r = 0; r < R; ++r) a[r] = acc[r] + d;
    pv_regs<R, 1>(pr, a, v + d, stride, n);
  }
}

template <typename KV>
inline void pv_rows(int nrows, const float* const* pr, float* const* acc, const KV* v,
                    int64_t stride, int64_t n, int64_t D) {
  static_assert(kRB == 6, "pv_rows dispatches 1..6 rows");
  switch (nrows) {
    case 1: pv_rows_d<1>(pr, acc, v, stride, n, D); break;
    case 2: pv_rows_d<2>(pr, acc, v, stride, n, D); break;
    case 3: pv_rows_d<3>(pr, acc, v, stride, n, D); break;
    case 4: pv_rows_d<4>(pr, acc, v, stride, n, D); break;
    case 5: pv_rows_d<5>(pr, acc, v, stride, n, D); break;
    default: pv_rows_d<6>(pr, acc, v, stride, n, D); break;
  }
}

// P.V over one page's n keys (V rows from vb, Hkv * D apart; probabilities s [nr, BS]; outputs
// acc [nr, D]), kPvKeys keys at a time: per KV head, its rows in blocks of up to kRB
// (token-major, the group's query heads), each block's outputs held in registers over the
// keys and each V row widened once per block (key by key, every row's output went through
// memory per key and a V row was widened once per query head). prefetch(t) fetches key t.
template <typename KV, typename Prefetch>
inline void pv_page(const Problem& p, int64_t nr, const float* s, float* acc, const KV* vb,
                    int64_t n, Prefetch prefetch) {
  const int64_t D = p.D, G = p.group, BS = p.BS, Hq = p.Hq, row_len = p.Hkv * D;
  for (int64_t j = 0; j < n; j += kPvKeys) {
    const int64_t nk = std::min(kPvKeys, n - j);
    for (int64_t t = 0; t < nk; ++t) prefetch(j + t + kAheadKeys);
    for (int64_t h = 0; h < p.Hkv; ++h) {
      const float* pr[kRB];
      float* ar[kRB];
      int nb = 0;
      for (int64_t row0 = 0; row0 < nr; row0 += Hq)
        for (int64_t qh = h * G; qh < (h + 1) * G; ++qh) {
          pr[nb] = s + (row0 + qh) * BS + j;
          ar[nb] = acc + (row0 + qh) * D;
          if (++nb == kRB) {
            pv_rows(nb, pr, ar, vb + j * row_len + h * D, row_len, nk, D);
            nb = 0;
          }
        }
      if (nb > 0) pv_rows(nb, pr, ar, vb + j * row_len + h * D, row_len, nk, D);
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXINFER_ATTN_BF16_DOT 1
// bf16 queries against a bf16 cache (a bf16 model's decode) on vdpbf16ps: a key's score is
// the dot product of the two bf16 rows as they are (32 exact products per instruction,
// float32 sums), with no widening of K. The 16 (unscaled) scores of keys k, k + stride, ...
// D = 32 ND: the query's ND vectors stay in registers and each key's row is read through
// one pointer stepping by the stride (with a loop over D inside, GCC kept 16 row pointers
// and the query on the stack, reloading them for every instruction).
template <int ND>
inline v16 dot_scores16(const uint16_t* q, const uint16_t* k, int64_t stride) {
  __m512bh qv[ND];
  for (int i = 0; i < ND; ++i) qv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * i));
  v16 part[16];
  for (int t = 0; t < 16; ++t, k += stride) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                reinterpret_cast<__m512bh>(_mm512_loadu_si512(k)));
    for (int i = 1; i < ND; ++i)
      a = _mm512_dpbf16_ps(a, qv[i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + 32 * i)));
    part[kBitReversed[t]] = reinterpret_cast<v16>(a);
  }
  return sum16(part);
}

template <typename KV>
inline v16 dot_scores16(const uint16_t* q, const KV* k, int64_t stride, int64_t D) {
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  switch (D) {
    case 32: return dot_scores16<1>(q, kb, stride);
    case 64: return dot_scores16<2>(q, kb, stride);
    case 128: return dot_scores16<4>(q, kb, stride);
    default: {  // (other multiples of 32, up to 512: the runtime loop)
      v16 out;
      for (int t = 0; t < 16; ++t) out[t] = 0.0f;
      for (int64_t d = 0; d < D; d += 32) out += dot_scores16<1>(q + d, kb + d, stride);
      return out;
    }
  }
}

template <typename KV>
inline float dot_score(const uint16_t* q, const KV* k, int64_t D) {
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32)
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + d)),
                           reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + d)));
  return hsum(reinterpret_cast<v16>(acc));
}

// P.V of a bf16 cache on vdpbf16ps: two keys per instruction. Keys t and t + 1's V rows are
// interleaved (vpunpck{l,h}wd: per 128-bit lane, values 0-3 then 4-7 of both rows as pairs)
// and each row's probabilities are rounded to bf16 pairs (p_t, p_t+1), so one instruction
// adds p_t v_t[d] + p_t+1 v_t+1[d] into 16 float32 sums (half the instructions of widening
// V and one FMA per key; FlashAttention rounds P for its P.V the same way). The sums are
// kept in that interleaved order over the whole item: per 32 values, 16 for d = 8L + i and 16
// for d = 8L + 4 + i (lane L, i < 4); unpermute_pv puts them back.
// Two keys' V rows v0, v1 (bf16, 32 C values each) as the pairs vdpbf16ps multiplies:
// vpunpck{l,h}wd per 32 values (x[2c], x[2c + 1]), in the order unpermute_pv undoes.
template <int C>
inline void v_pairs(const uint16_t* v0, const uint16_t* v1, __m512bh (&x)[2 * C]) {
  for (int c = 0; c < C; ++c) {
    const __m512i r0 = _mm512_loadu_si512(v0 + 32 * c);
    const __m512i r1 = _mm512_loadu_si512(v1 + 32 * c);
    x[2 * c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, r1));
    x[2 * c + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, r1));
  }
}

template <int R, int C>
inline void pv_regs_bf16(const uint32_t* const* pp, float* const* acc, const uint16_t* v,
                         int64_t stride, int64_t npairs, int64_t nk) {
  __m512 a[R][2 * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c) a[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
  for (int64_t u = 0; u < npairs; ++u) {
    const uint16_t* v0 = v + 2 * u * stride;
    const uint16_t* v1 = 2 * u + 1 < nk ? v0 + stride : v0;  // (an odd last key: p pair (p, 0))
    __m512bh x[2 * C];
    v_pairs<C>(v0, v1, x);
    for (int r = 0; r < R; ++r) {
      const __m512bh e = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pp[r][u]));
      for (int c = 0; c < 2 * C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], e, x[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}

template <int R>
inline void pv_rows_d_bf16(const uint32_t* const* pp, float* const* acc, const uint16_t* v,
                           int64_t stride, int64_t npairs, int64_t nk, int64_t D) {
  float* a[R];
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    for (int r = 0; r < R; ++r) a[r] = acc[r] + d;
    pv_regs_bf16<R, 2>(pp, a, v + d, stride, npairs, nk);
  }
  for (; d < D; d += 32) {
    for (int r = 0; r < R; ++r) a[r] = acc[r] + d;
    pv_regs_bf16<R, 1>(pp, a, v + d, stride, npairs, nk);
  }
}

inline void pv_rows_bf16(int nrows, const uint32_t* const* pp, float* const* acc,
                         const uint16_t* v, int64_t stride, int64_t npairs, int64_t nk,
                         int64_t D) {
  static_assert(kRB == 6, "pv_rows_bf16 dispatches 1..6 rows");
  switch (nrows) {
    case 1: pv_rows_d_bf16<1>(pp, acc, v, stride, npairs, nk, D); break;
    case 2: pv_rows_d_bf16<2>(pp, acc, v, stride, npairs, nk, D); break;
    case 3: pv_rows_d_bf16<3>(pp, acc, v, stride, npairs, nk, D); break;
    case 4: pv_rows_d_bf16<4>(pp, acc, v, stride, npairs, nk, D); break;
    case 5: pv_rows_d_bf16<5>(pp, acc, v, stride, npairs, nk, D); break;
    default: pv_rows_d_bf16<6>(pp, acc, v, stride, npairs, nk, D); break;
  }
}

// pv_page for a bf16 cache (D % 32 == 0): the rows' probabilities s [nr, BS] rounded to bf16
// pairs in sb (nr rows of BS / 2 + 1 pairs), then P.V as pv_page does it, two keys a step.
template <typename Prefetch>
inline void pv_page_bf16(const Problem& p, int64_t nr, const float* s, uint32_t* sb,
                         float* acc, const BF16* vb, int64_t n, Prefetch prefetch) {
  const int64_t D = p.D, G = p.group, BS = p.BS, Hq = p.Hq, row_len = p.Hkv * D;
  const int64_t pairs_len = BS / 2 + 1;
  for (int64_t row = 0; row < nr; ++row) {
    const float* sr = s + row * BS;
    uint16_t* out = reinterpret_cast<uint16_t*>(sb + row * pairs_len);
    int64_t t = 0;
    for (; t + 32 <= n; t += 32)
      _mm512_storeu_si512(out + t, reinterpret_cast<__m512i>(
                                       _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + t + 16),
                                                           _mm512_loadu_ps(sr + t))));
    if (t < n) {
      const int64_t m = n - t;
      const __mmask16 lo = static_cast<__mmask16>((1u << std::min<int64_t>(m, 16)) - 1);
      const __mmask16 hi = static_cast<__mmask16>(m > 16 ? (1u << (m - 16)) - 1 : 0);
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, sr + t + 16),
                                             _mm512_maskz_loadu_ps(lo, sr + t));
      _mm512_mask_storeu_epi16(out + t, static_cast<__mmask32>((uint64_t{1} << m) - 1),
                               reinterpret_cast<__m512i>(h));
    }
    if (n % 2) out[n] = 0;  // (the odd last key's partner weighs 0)
  }
  const uint16_t* vbits = reinterpret_cast<const uint16_t*>(vb);
  for (int64_t j = 0; j < n; j += kPvKeys) {  // (kPvKeys even: pairs never straddle blocks)
    const int64_t nk = std::min(kPvKeys, n - j);
    const int64_t npairs = (nk + 1) / 2;
    for (int64_t t = 0; t < nk; ++t) prefetch(j + t + kAheadKeys);
    for (int64_t h = 0; h < p.Hkv; ++h) {
      const uint32_t* pr[kRB];
      float* ar[kRB];
      int nb = 0;
      for (int64_t row0 = 0; row0 < nr; row0 += Hq)
        for (int64_t qh = h * G; qh < (h + 1) * G; ++qh) {
          pr[nb] = sb + (row0 + qh) * pairs_len + j / 2;
          ar[nb] = acc + (row0 + qh) * D;
          if (++nb == kRB) {
            pv_rows_bf16(nb, pr, ar, vbits + j * row_len + h * D, row_len, npairs, nk, D);
            nb = 0;
          }
        }
      if (nb > 0) pv_rows_bf16(nb, pr, ar, vbits + j * row_len + h * D, row_len, npairs, nk, D);
    }
  }
}

// The sums of pv_page_bf16 back in d order, for nr rows of D (a multiple of 32).
inline void unpermute_pv(float* acc, int64_t nr, int64_t D) {
  float tmp[32];
  for (int64_t c = 0; c < nr * D; c += 32) {
    for (int L = 0; L < 4; ++L)
      for (int i = 0; i < 4; ++i) {
        tmp[8 * L + i] = acc[c + 4 * L + i];
        tmp[8 * L + 4 + i] = acc[c + 16 + 4 * L + i];
      }
    std::copy(tmp, tmp + 32, acc + c);
  }
}

// Scores of 16 * NV rows x kKeys keys of a bf16 model's prefill on vdpbf16ps: qp [D / 2, RP]
// holds each row's bf16 values 2i and 2i + 1 as one 32-bit word (the rows transposed), k[j]
// key j's cache row as such words; each word of a key is broadcast against NV vectors of
// rows (32 exact products per instruction, float32 sums). st[key, row] = score x scale, as
// scores_block leaves them.
template <int NV>
inline void scores_block_bf16(const uint32_t* qp, int64_t RP, const uint32_t* const* k,
                              int64_t words, float scale, float* st) {
  __m512 acc[NV][kKeys];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < words; ++i) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v)
      q[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qp + i * RP + 16 * v));
    for (int j = 0; j < kKeys; ++j) {
      const __m512bh kj =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(k[j][i])));
      for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], q[v], kj);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < kKeys; ++j)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(st + j * RP + 16 * v, _mm512_mul_ps(acc[v][j], sc));
}

// P.V of kRB rows (nr of them stored) on vdpbf16ps, two keys per instruction as in
// pv_regs_bf16: pb [pairs, RP] holds row i's probabilities of keys 2u and 2u + 1, rounded to
// bf16, as word u * RP + i; V rows of n keys from v (bf16, vs apart), 32 C values; acc rows
// (D apart) in pv_regs_bf16's interleaved order.
template <int C>
inline void pv_block_bf16(const uint32_t* pb, int64_t RP, const uint16_t* v, int64_t vs,
                          int64_t n, float* acc, int64_t D, int64_t nr) {
  __m512 a[kRB][2 * C];
  for (int64_t i = 0; i < kRB; ++i)
    for (int c = 0; c < 2 * C; ++c)
      a[i][c] = i < nr ? _mm512_loadu_ps(acc + i * D + 16 * c) : _mm512_setzero_ps();
  for (int64_t u = 0; 2 * u < n; ++u) {
    const uint16_t* v0 = v + 2 * u * vs;
    const uint16_t* v1 = 2 * u + 1 < n ? v0 + vs : v0;  // (an odd last key's partner weighs 0)
    __m512bh x[2 * C];
    v_pairs<C>(v0, v1, x);
    for (int64_t i = 0; i < kRB; ++i) {
      const __m512bh e =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pb[u * RP + i])));
      for (int c = 0; c < 2 * C; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], e, x[c]);
    }
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, a[i][c]);
}

// softmax_page for run_blocked_item_bf16: the probabilities go straight into bf16 pairs of
// keys, pb [pairs, RP] (word u * RP + i: row i's probabilities of keys 2u and 2u + 1; an odd
// last key's partner 0), and the scores stay as they are (the masks are applied in
// registers in both passes: no store of masked scores, of float32 probabilities, nor a
// third pass to pair them). l sums the float32 probabilities, as in decode items.
inline void softmax_page_pairs(const float* st, int64_t RP, int64_t RV, int64_t rows,
                               int64_t n, int64_t j0, bool masked, const float* pos,
                               const float* first, float* m, float* l, float* acc, int64_t D,
                               uint32_t* pb) {
  // Lane i of a pair: word i of the first key's probabilities, then word i of the second's.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                               25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                               18, 2, 17, 1, 16, 0);
  for (int64_t rv = 0; rv < RV; ++rv) {
    const __m512 last = _mm512_loadu_ps(pos + 16 * rv), from = _mm512_loadu_ps(first + 16 * rv);
    auto visible = [&](int64_t j) -> __mmask16 {  // the rows that see key j0 + j
      const __m512 key = _mm512_set1_ps(static_cast<float>(j0 + j));
      return _mm512_cmp_ps_mask(key, last, _CMP_LE_OQ) & _mm512_cmp_ps_mask(key, from, _CMP_GE_OQ);
    };
    const __m512 m_old = _mm512_loadu_ps(m + 16 * rv);
    __m512 mx = m_old;
    for (int64_t j = 0; j < n; ++j) {
      const __m512 sc = _mm512_loadu_ps(st + j * RP + 16 * rv);
      mx = masked ? _mm512_mask_max_ps(mx, visible(j), mx, sc) : _mm512_max_ps(mx, sc);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t u = 0; 2 * u < n; ++u) {
      const int64_t j = 2 * u;
      __m512 e0 = exp16_scalef(_mm512_sub_ps(_mm512_loadu_ps(st + j * RP + 16 * rv), mx));
      __m512 e1 = _mm512_setzero_ps();
      if (j + 1 < n)
        e1 = exp16_scalef(_mm512_sub_ps(_mm512_loadu_ps(st + (j + 1) * RP + 16 * rv), mx));
      if (masked) {
        e0 = _mm512_maskz_mov_ps(visible(j), e0);
        e1 = _mm512_maskz_mov_ps(j + 1 < n ? visible(j + 1) : __mmask16{0}, e1);
      }
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0));
      _mm512_storeu_si512(pb + u * RP + 16 * rv, _mm512_permutexvar_epi16(interleave, h));
    }
    // 1 while a row has seen no key (acc is 0); a row that sees none of this page keeps m
    const __m512 corr = exp16_scalef(_mm512_sub_ps(m_old, mx));
    _mm512_storeu_ps(l + 16 * rv, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * rv), corr, sum));
    _mm512_storeu_ps(m + 16 * rv, mx);
    float cs[16];
    _mm512_storeu_ps(cs, corr);
    for (int64_t i = 0; i < 16 && 16 * rv + i < rows; ++i) {
      float* ar = acc + (16 * rv + i) * D;
      const __m512 c = _mm512_set1_ps(cs[i]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), c));
    }
  }
}

// run_blocked_item for bf16 queries over a bf16 cache (D a multiple of 32): the same pages,
// masks and online softmax, with the scores from the bf16 rows as they are (no widened copy
// of K or q; scaled after, as decode items do) and P.V on bf16 probabilities, two keys a
// step, V read from the cache as it is (the probabilities rounded as decode items and
// FlashAttention round them). Returns false on an out-of-range block id.
bool run_blocked_item_bf16(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t D = p.D, G = p.group, BS = p.BS, W = D / 2, row_len = p.Hkv * D;
  const Span sp = span_of(p, it);
  const int64_t start = sp.start, ctx = sp.ctx, r0 = sp.r0, r1 = sp.r1, lo = sp.lo, hi = sp.hi;
  const int64_t rows = (r1 - r0) * G;  // (query token, head in group) pairs
  const int64_t RP = (rows + 15) / 16 * 16, RV = RP / 16;
  const int64_t BSP = (BS + kKeys - 1) / kKeys * kKeys, PP = BSP / 2 + 2;
  // scratch (4-byte words): qp [W, RP] | st [BSP + 1, RP] | pb [PP, RP] | acc [rows, D] |
  // m, l, pos, first [RP] (pb's extra rows: P.V's last register block reads past the rows)
  scratch.resize(static_cast<size_t>(W * RP + (BSP + 1) * RP + PP * RP + rows * D + 4 * RP));
  uint32_t* qp = reinterpret_cast<uint32_t*>(scratch.data());
  float* st = scratch.data() + W * RP;
  uint32_t* pb = reinterpret_cast<uint32_t*>(st + (BSP + 1) * RP);
  float* acc = st + (BSP + 1) * RP + PP * RP;
  float* m = acc + rows * D;
  float* l = m + RP;
  float* pos = l + RP;
  float* first = pos + RP;
  prefetch_q_rows(p, start, r0, r1, it.head);
  start_tile_rows(p, ctx, r0, rows, RP, pos, first, m, l);
  std::fill(pb, pb + PP * RP, 0u);
  std::fill(qp, qp + W * RP, 0u);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  for (int64_t row = 0; row < rows; ++row) {
    const uint16_t* src = q + ((start + r0 + row / G) * p.Hq + it.head * G + row % G) * D;
    for (int64_t i = 0; i < W; ++i) std::memcpy(qp + i * RP + row, src + 2 * i, 4);
  }
  std::fill(acc, acc + rows * D, 0.0f);
  const uint16_t* kc = static_cast<const uint16_t*>(p.k);
  const uint16_t* vc = static_cast<const uint16_t*>(p.v);
  const bool ok = for_each_page(p, it.seq, lo, hi, [&](const PageSpan& pg) {
    const int64_t j0 = pg.j0, n = pg.n, j1 = j0 + n;
    const int64_t first_key = (pg.slot * p.Hkv + it.head) * D;
    const uint16_t* kp = kc + first_key;
    const uint16_t* vp = vc + first_key;
    // Scores [n, RP] (keys past n repeat the last one; their scores are never read).
    for (int64_t c = 0; c < n; c += kKeys) {
      const uint32_t* k[kKeys];
      for (int64_t j = 0; j < kKeys; ++j)
        k[j] = reinterpret_cast<const uint32_t*>(kp + std::min(c + j, n - 1) * row_len);
      for (int64_t rv = 0; rv < RV; rv += 3) {
        float* out = st + c * RP + 16 * rv;
        switch (std::min<int64_t>(3, RV - rv)) {
          case 1: scores_block_bf16<1>(qp + 16 * rv, RP, k, W, p.scale, out); break;
          case 2: scores_block_bf16<2>(qp + 16 * rv, RP, k, W, p.scale, out); break;
          default: scores_block_bf16<3>(qp + 16 * rv, RP, k, W, p.scale, out); break;
        }
      }
    }
    softmax_page_pairs(st, RP, RV, rows, n, j0, p.window > 0 || j1 - 1 > ctx + r0, pos, first,
                       m, l, acc, D, pb);
    for (int64_t r = 0; r < rows; r += kRB) {
      const int64_t nr = std::min(kRB, rows - r);
      int64_t d = 0;
      for (; d + 64 <= D; d += 64)
        pv_block_bf16<2>(pb + r, RP, vp + d, row_len, n, acc + r * D + d, D, nr);
      if (d < D) pv_block_bf16<1>(pb + r, RP, vp + d, row_len, n, acc + r * D + d, D, nr);
    }
  });
  if (!ok) return false;
  unpermute_pv(acc, rows, D);
  store_tile_rows(p, it, start, r0, rows, acc, m, l);
  return true;
}
#endif

template <typename KV>
bool run_decode_item(const Problem& p, const Item& it, std::vector<float>& scratch) {
  constexpr int64_t kLine = 64 / sizeof(KV);  // cache entries per 64-byte line
  const int64_t D = p.D, G = p.group, BS = p.BS, Hq = p.Hq, row_len = p.Hkv * D;
  const Span sp = span_of(p, it);
  const int64_t start = sp.start, ctx = sp.ctx, r0 = sp.r0, r1 = sp.r1;
  const int64_t lo = it.part < 0 ? sp.lo : std::max<int64_t>(sp.lo, it.k0);
  const int64_t hi = it.part < 0 ? sp.hi : std::min<int64_t>(sp.hi, it.k1);
  const int64_t nr = (r1 - r0) * Hq;  // rows (query token, query head), token-major
  // A bf16 model's P.V (bf16 rows and cache) on vdpbf16ps (pv_page_bf16), its sums in their
  // own order until the end; float32 rows over a bf16 cache keep exact float32 products.
#if defined(JAXINFER_ATTN_BF16_DOT)
  constexpr bool kBf16Cache = std::is_same<KV, BF16>::value;
#else
  constexpr bool kBf16Cache = false;
#endif
  const bool pv_bf16 = kBf16Cache && D % 32 == 0 && p.q_kind == Kind::kBF16;
  // scratch: q [nr, D] | acc [nr, D] | m, l [nr] | probabilities [nr, BS] | their bf16 pairs
  // [nr, BS / 2 + 1] (pv_bf16)
  scratch.resize(static_cast<size_t>(2 * nr * D + 2 * nr + nr * BS +
                                     (pv_bf16 ? nr * (BS / 2 + 1) : 0)));
  float* qf = scratch.data();
  float* acc = qf + nr * D;
  float* m = acc + nr * D;
  float* l = m + nr;
  float* s = l + nr;
  [[maybe_unused]] uint32_t* sb = reinterpret_cast<uint32_t*>(s + nr * BS);
  const int64_t q0 = (start + r0) * Hq * D;  // (q and out: float32, bf16 or f16)
#if defined(JAXINFER_ATTN_BF16_DOT)
  // bf16 q and cache: scores from the rows as stored (dot_scores16), scaled after; qf unused.
  const uint16_t* qb = std::is_same<KV, BF16>::value && p.q_kind == Kind::kBF16 && D % 32 == 0
                           ? static_cast<const uint16_t*>(p.q) + q0
                           : nullptr;
  if (qb == nullptr)
#endif
    load_row(p, q0, p.scale, nr * D, qf);
  std::fill(acc, acc + nr * D, 0.0f);
  std::fill(m, m + nr, kMaskValue);
  std::fill(l, l + nr, 0.0f);
  const int32_t* table = p.tables + it.seq * p.MB;
  const KV* kc = static_cast<const KV*>(p.k);
  const KV* vc = static_cast<const KV*>(p.v);
  const bool ok = for_each_page(p, it.seq, lo, hi, [&](const PageSpan& pg) {
    const int64_t j0 = pg.j0, n = pg.n;
    const int64_t page = pg.page;
    const int64_t first = pg.slot * row_len;
    const KV* kb = kc + first;
    const KV* vb = vc + first;
    // Keys are fetched kAheadKeys ahead of the one being read, into the next page near this
    // one's end (the hardware prefetcher cannot know where it is): K during the scores, V
    // during P.V. (Fetching only the next page, spread over this one, left every sequence's
    // first page to the hardware prefetcher: decode 32 x 256 read 14 GB/s, now ~18.5.)
    const KV* next_k = nullptr;
    const KV* next_v = nullptr;
    if ((page + 1) * BS < hi) {
      const int64_t nb = table[page + 1];
      if (nb >= 0 && nb < p.NB) {  // (a bad id is refused when its page comes)
        next_k = kc + nb * BS * row_len;
        next_v = vc + nb * BS * row_len;
      }
    }
    // Key t's row: of this page, or past its end of the next (nullptr past that).
    auto key_row = [&](const KV* here, const KV* next, int64_t t, int64_t n_here) -> const KV* {
      return t < n_here ? here + t * row_len
                        : (next != nullptr && t - n_here < BS ? next + (t - n_here) * row_len
                                                             : nullptr);
    };
    // Key t into L1 (every line of its row), and key t + kFarKeys - kAheadKeys into L2: with
    // L1 prefetches alone, each in flight holds one of the core's few L1 miss buffers, and
    // 8 keys ahead was too short a lead for DRAM (bf16 decode-32@256 read 13.5 GB/s; with
    // the L2 prefetches 19, float32 18 -> 21: benchmarks/cpu_attention.py, AMD Zen 4 VM).
    auto prefetch_key = [&](const KV* here, const KV* next, int64_t t, int64_t n_here) {
      const KV* r = key_row(here, next, t, n_here);
      if (r != nullptr)
        for (int64_t b = 0; b < row_len; b += kLine) jaxinfer_cpu::prefetch(r + b);
      constexpr int64_t far = sizeof(KV) == 2 ? kFarKeys2 : kFarKeys;
      const KV* f = key_row(here, next, t + far - kAheadKeys, n_here);
      if (f != nullptr)
        for (int64_t b = 0; b < row_len; b += kLine) jaxinfer_cpu::prefetch_l2(f + b);
    };
    // Key t's V row into L2 while the scores read K: the page's P.V then starts on rows in
    // cache (it had started on rows nobody fetched, every page: the first loads of P.V held
    // ~20% of a bf16 decode-32@256 item's samples).
    auto prefetch_v = [&](int64_t t) {
      if (t >= n) return;
      const KV* r = vb + t * row_len;
      for (int64_t b = 0; b < row_len; b += kLine) jaxinfer_cpu::prefetch_l2(r + b);
    };
    // Scores, 16 keys at a time: per row, 16 partial dot products reduced together into
    // the 16 scores (sum16), not each summed across its lanes on its own.
    int64_t j = 0;
#if defined(JAXINFER_V16_PAIR)
    // (AVX2 only: 8 keys at a time, each key's partial products one 8-float vector: 16
    // keys' pairs would need all 32 halves in the 16 registers)
    for (; j + 8 <= n; j += 8) {
      for (int64_t t = 0; t < 8; ++t) prefetch_key(kb, next_k, j + t + kAheadKeys, n);
      for (int64_t t = 0; t < 8; ++t) prefetch_v(j + t);
      const KV* kr = kb + j * row_len;
      for (int64_t qh = 0; qh < Hq; ++qh) {
        const KV* kh = kr + (qh / G) * D;
        for (int64_t row = qh; row < nr; row += Hq) {
          const float* qr = qf + row * D;
          jaxinfer_cpu::v8 part[8];
          const v16 q0 = load16(qr);
          for (int t = 0; t < 8; ++t) {
            const v16 k = kv16(kh + t * row_len);
            part[kBitReversed8[t]] = q0.lo * k.lo + q0.hi * k.hi;
          }
          for (int64_t d = 16; d < D; d += 16) {
            const v16 qd = load16(qr + d);
            for (int t = 0; t < 8; ++t) {
              const v16 k = kv16(kh + t * row_len + d);
              part[kBitReversed8[t]] += qd.lo * k.lo + qd.hi * k.hi;
            }
          }
          *reinterpret_cast<jaxinfer_cpu::v8u*>(s + row * BS + j) = sum8(part);
        }
      }
    }
#else
    for (; j + 16 <= n; j += 16) {
      for (int64_t t = 0; t < 16; ++t) prefetch_key(kb, next_k, j + t + kAheadKeys, n);
      for (int64_t t = 0; t < 16; ++t) prefetch_v(j + t);
      const KV* kr = kb + j * row_len;
      for (int64_t qh = 0; qh < Hq; ++qh) {
        const KV* kh = kr + (qh / G) * D;  // (once per 16 keys)
        for (int64_t row = qh; row < nr; row += Hq) {
#if defined(JAXINFER_ATTN_BF16_DOT)
          if (qb != nullptr) {
            store16(s + row * BS + j, dot_scores16(qb + row * D, kh, row_len, D) * p.scale);
            continue;
          }
#endif
          const float* qr = qf + row * D;
          v16 part[16];
          const v16 q0 = load16(qr);
          for (int t = 0; t < 16; ++t) part[kBitReversed[t]] = q0 * kv16(kh + t * row_len);
          for (int64_t d = 16; d < D; d += 16) {
            const v16 qd = load16(qr + d);
            for (int t = 0; t < 16; ++t) part[kBitReversed[t]] += qd * kv16(kh + t * row_len + d);
          }
          store16(s + row * BS + j, sum16(part));
        }
      }
    }
#endif
    // The page's last keys (fewer than 16), one by one.
    for (; j < n; ++j) {
      prefetch_key(kb, next_k, j + kAheadKeys, n);
      prefetch_v(j);
      const KV* kr = kb + j * row_len;
      for (int64_t qh = 0; qh < Hq; ++qh) {
        const KV* kh = kr + (qh / G) * D;
        for (int64_t row = qh; row < nr; row += Hq) {
#if defined(JAXINFER_ATTN_BF16_DOT)
          if (qb != nullptr) {
            s[row * BS + j] = dot_score(qb + row * D, kh, D) * p.scale;
            continue;
          }
#endif
          const float* qr = qf + row * D;
          v16 part = load16(qr) * kv16(kh);
          for (int64_t d = 16; d < D; d += 16) part += load16(qr + d) * kv16(kh + d);
          s[row * BS + j] = hsum(part);
        }
      }
    }
    // Online softmax per row; probabilities outside a row's visible keys are 0.
    for (int64_t row = 0; row < nr; ++row) {
      const int64_t pos = ctx + r0 + row / Hq;
      const int64_t a = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - j0) : 0;
      const int64_t b = std::max<int64_t>(a, std::min<int64_t>(n, pos + 1 - j0));
      float* sr = s + row * BS;
      if (a >= b) {
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      float mx = m[row];
      for (int64_t j = a; j < b; ++j) mx = std::max(mx, sr[j]);
      const float corr = std::exp(m[row] - mx);  // 0 on the row's first page
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = a; j < b; ++j) {
        sr[j] = std::exp(sr[j] - mx);
        sum += sr[j];
      }
      std::fill(sr, sr + a, 0.0f);
      std::fill(sr + b, sr + n, 0.0f);
      float* ar = acc + row * D;
      for (int64_t d = 0; d < D; d += 16) store16(ar + d, load16(ar + d) * corr);
      l[row] = l[row] * corr + sum;
      m[row] = mx;
    }
    // P.V in register blocks (pv_page). A float32 cache took the key-by-key loop below until
    // 2026-11-30: blocked, its decode had run ~7% slower from DRAM on an AMD Zen 4 VM; on a
    // Zen 5 VM the blocked form reads 4-12% faster from DRAM and ~20% faster from L3, where
    // the key-by-key loop's load-add-store of every output held ~30% of the kernel's samples
    // (results/cpu_attention_f32_blocked_pv_zen5.json). AVX2 builds keep that loop.
#if !defined(JAXINFER_V16_PAIR)
#if defined(JAXINFER_ATTN_BF16_DOT)
    if constexpr (std::is_same<KV, BF16>::value) {
      if (pv_bf16) {
        pv_page_bf16(p, nr, s, sb, acc, vb, n,
                     [&](int64_t t) { prefetch_key(vb, next_v, t, n); });
        return;  // (this page done)
      }
    }
#endif
    pv_page(p, nr, s, acc, vb, n, [&](int64_t t) { prefetch_key(vb, next_v, t, n); });
#else
    {  // P.V, key by key.
      for (int64_t j = 0; j < n; ++j) {
        prefetch_key(vb, next_v, j + kAheadKeys, n);
        const KV* vr = vb + j * row_len;
        for (int64_t h = 0; h < p.Hkv; ++h) {  // (no division per row: this loop is hot)
          const KV* vh = vr + h * D;
          for (int64_t qh = h * G; qh < (h + 1) * G; ++qh)
            for (int64_t row = qh; row < nr; row += Hq) {
              const float e = s[row * BS + j];
              float* ar = acc + row * D;
              for (int64_t d = 0; d < D; d += 16)
                store16(ar + d, load16(ar + d) + e * kv16(vh + d));
            }
        }
      }
    }
#endif
  });
  if (!ok) return false;
#if defined(JAXINFER_ATTN_BF16_DOT)
  if (pv_bf16) unpermute_pv(acc, nr, D);
#endif
  if (it.part >= 0) {  // (combine_parts finishes the rows)
    float* part = p.parts + it.part * p.part_stride;
    std::copy(m, m + nr, part);
    std::copy(l, l + nr, part + nr);
    std::copy(acc, acc + nr * D, part + 2 * nr);
    return true;
  }
  for (int64_t row = 0; row < nr; ++row)
    store_row(p, q0 + row * D, acc + row * D, inv_denominator(p, row % Hq, m[row], l[row]), D);
  return true;
}

// The output rows of a tile whose keys were split over the n items from `first` on: each
// part's sums rescaled to the largest running max, added, then normalized as one item would
// (a part that saw no visible key has max kMaskValue and weighs 0).
void combine_parts(const Problem& p, const Item* first, int64_t n) {
  const Span sp = span_of(p, *first);
  const int64_t D = p.D, Hq = p.Hq, nr = (sp.r1 - sp.r0) * Hq;
  const int64_t q0 = (sp.start + sp.r0) * Hq * D;
  float out[512];  // (one row; D <= 512, checked by the caller)
  for (int64_t row = 0; row < nr; ++row) {
    float mx = kMaskValue;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p.parts[first[i].part * p.part_stride + row]);
    float l = 0.0f;
    std::fill(out, out + D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float* part = p.parts + first[i].part * p.part_stride;
      const float w = std::exp(part[row] - mx);
      l += part[nr + row] * w;
      const float* a = part + 2 * nr + row * D;
      for (int64_t d = 0; d < D; ++d) out[d] += a[d] * w;
    }
    store_row(p, q0 + row * D, out, inv_denominator(p, row % Hq, mx, l), D);
  }
}

struct Shared {
  Problem problem;
  std::vector<float> parts;  // (problem.parts' storage)
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> bad_block{false};
};

void work(Shared& sh) {
  thread_local std::vector<float> scratch;
  const int64_t n = static_cast<int64_t>(sh.items.size());
  for (;;) {
    const int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    const Problem& p = sh.problem;
    const Item& it = sh.items[i];
    bool ok;
    if (!it.decode)
      ok = run_item(p, it, scratch);
    else if (p.kv_kind == Kind::kF8E4M3)
      ok = run_decode_item<E4M3>(p, it, scratch);
    else if (p.kv_kind == Kind::kF8E5M2)
      ok = run_decode_item<E5M2>(p, it, scratch);
    else if (p.kv_kind == Kind::kBF16)
      ok = run_decode_item<BF16>(p, it, scratch);
    else
      ok = run_decode_item<float>(p, it, scratch);
    if (!ok)
      sh.bad_block.store(true);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

bool kind_of(ffi::DataType t, Kind* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = Kind::kF32; return true;
    case ffi::DataType::BF16: *kind = Kind::kBF16; return true;
    case ffi::DataType::F16: *kind = Kind::kF16; return true;
    case ffi::DataType::F8E4M3FN: *kind = Kind::kF8E4M3; return true;
    case ffi::DataType::F8E5M2: *kind = Kind::kF8E5M2; return true;
    default: return false;
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                              float sm_scale,
                              int64_t sliding_window, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  auto vd = v_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("paged_attention_cpu: bad ranks or k/v shapes differ");
  auto sh = std::make_shared<Shared>();
  Problem& p = sh->problem;
  p.T = qd[0]; p.Hq = qd[1]; p.D = qd[2];
  p.NB = kd[0]; p.BS = kd[1]; p.Hkv = kd[2];
  p.R = td[0]; p.MB = td[1];
  if (kd[3] != p.D || p.Hkv <= 0 || p.Hq % p.Hkv != 0)
    return ffi::Error::InvalidArgument("paged_attention_cpu: head shapes do not match");
  if (kv_lens.element_count() != static_cast<size_t>(p.R) ||
      query_start_loc.element_count() != static_cast<size_t>(p.R + 1))
    return ffi::Error::InvalidArgument("paged_attention_cpu: kv_lens / query_start_loc size");
  if (!kind_of(q.element_type(), &p.q_kind) || !kind_of(k_cache.element_type(), &p.kv_kind) ||
      v_cache.element_type() != k_cache.element_type() || out->element_type() != q.element_type() ||
      p.q_kind == Kind::kF8E4M3 || p.q_kind == Kind::kF8E5M2)
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be f32, bf16 or f16, the "
                                       "caches also fp8 (e4m3fn, e5m2)");
  if (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(p.Hq))
    return ffi::Error::InvalidArgument("paged_attention_cpu: sinks must hold 0 or Hq values");
  p.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  p.group = p.Hq / p.Hkv;
  p.window = sliding_window;
  p.scale = sm_scale;
  p.q = q.untyped_data();
  p.k = k_cache.untyped_data();
  p.v = v_cache.untyped_data();
  p.out = out->untyped_data();
  p.kv_lens = kv_lens.typed_data();
  p.tables = block_tables.typed_data();
  p.qsl = query_start_loc.typed_data();
  const int64_t ns = num_seqs.typed_data()[0];
  if (ns < 0 || ns > p.R)
    return ffi::Error::InvalidArgument("paged_attention_cpu: num_seqs out of range");
  if (p.qsl[0] != 0) return ffi::Error::InvalidArgument("paged_attention_cpu: query_start_loc[0]");
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t q_len = p.qsl[s + 1] - p.qsl[s], kv_len = p.kv_lens[s];
    if (q_len < 0 || p.qsl[s + 1] > p.T || kv_len < q_len || kv_len > p.MB * p.BS)
      return ffi::Error::InvalidArgument(
          "paged_attention_cpu: query_start_loc / kv_lens out of range");
  }
  // Items: per sequence, tile and KV head; but a sequence whose tiles are a few decode rows
  // gets one item per tile taking all KV heads (run_decode_item: each page read as one
  // contiguous run instead of head-strided pieces; decode is bound by these bytes), where there
  // are tiles enough to share out. Where there are not (a batch of one to seven sequences),
  // such a tile's keys are split, page-aligned, into items of kMinSplitKeys or more, enough
  // for every thread, and combine_parts adds them up: a lone sequence's attention then reads
  // its pages on every core, in contiguous runs (per KV head, 3 items of SmolLM2 on 2 cores
  // left one core idle half the time, each reading head-strided pieces).
  int64_t tiles = 0;
  for (int64_t s = 0; s < ns; ++s) tiles += (p.qsl[s + 1] - p.qsl[s] + kTile - 1) / kTile;
  const bool kinds_ok = (p.kv_kind == Kind::kF32 || p.kv_kind == Kind::kBF16 ||
                         p.kv_kind == Kind::kF8E4M3 || p.kv_kind == Kind::kF8E5M2) &&
                        p.D % 16 == 0;
  const bool decode_ok = tiles >= 8 && kinds_ok;
  const bool split_ok = tiles < 8 && kinds_ok && p.D <= 512;
  const int64_t workers = 1 + jaxinfer_cpu::helper_count(pool.num_threads(), 1 << 20);
  int64_t parts = 0, max_rows = 0;
  std::vector<std::pair<int64_t, int64_t>> splits;  // (first item, items) per split tile
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t q_len = p.qsl[s + 1] - p.qsl[s];
    const bool small = std::min(q_len, kTile) * p.group < kBlockedMinRows;
    if (split_ok && small && q_len > 0) {
      Item it{static_cast<int32_t>(s), 0, 0, true};
      const Span sp = span_of(p, it);
      const int64_t keys = sp.hi - sp.lo;
      const int64_t n = std::min<int64_t>(keys / kMinSplitKeys,
                                          std::max<int64_t>(1, 4 * workers / tiles));
      if (n >= 2) {
        const int64_t chunk = ((keys + n - 1) / n + p.BS - 1) / p.BS * p.BS;
        const int64_t base = static_cast<int64_t>(sh->items.size());
        for (int64_t k0 = sp.lo / p.BS * p.BS; k0 < sp.hi; k0 += chunk) {
          it.part = static_cast<int32_t>(parts++);
          it.k0 = static_cast<int32_t>(k0);
          it.k1 = static_cast<int32_t>(std::min<int64_t>(sp.hi, k0 + chunk));
          sh->items.push_back(it);
        }
        splits.push_back({base, static_cast<int64_t>(sh->items.size()) - base});
        max_rows = std::max(max_rows, q_len);
        continue;
      }
    }
    const bool decode = decode_ok && small;
    const int32_t step = decode ? static_cast<int32_t>(p.Hkv) : 1;
    for (int32_t h = 0; h < p.Hkv; h += step)
      for (int64_t t = 0; t * kTile < q_len; ++t)
        sh->items.push_back({static_cast<int32_t>(s), h, static_cast<int32_t>(t), decode});
  }
  if (parts) {
    p.part_stride = max_rows * p.Hq * (p.D + 2);
    sh->parts.resize(static_cast<size_t>(parts * p.part_stride));
    p.parts = sh->parts.data();
  }
  // Padding rows are zero.
  const int64_t row_bytes = p.Hq * p.D * (p.q_kind == Kind::kF32 ? 4 : 2);
  const int64_t used = p.qsl[ns];
  std::memset(static_cast<char*>(p.out) + used * row_bytes, 0, (p.T - used) * row_bytes);
  const int64_t n = static_cast<int64_t>(sh->items.size());
  const int64_t helpers = jaxinfer_cpu::helper_count(pool.num_threads(), n);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work(*sh); });
  work(*sh);
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  if (sh->bad_block.load())
    return ffi::Error::InvalidArgument("paged_attention_cpu: block id out of range");
  for (const auto& [first, count] : splits) combine_parts(p, &sh->items[first], count);
  return ffi::Error::Success();
}

// This step's k, v [T, Hkv, D] copied into the caches [NB, BS, Hkv, D] at slot_mapping
// (slot = block * BS + offset; slots outside the cache are skipped, as XLA's scatter drops
// them). The outputs alias the caches, so only T rows move. For fp8 caches: XLA:CPU has no
// fp8 scatter, and scattering on the caches' bytes instead made it convert the whole cache to
// bytes and back each layer (bitcast-convert is a copy there: ~2 ms a layer, a batch-1 step
// 12x slower than with a float32 cache). Any element type, k's the caches'.
ffi::Error KvWriteImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), td = k.dimensions();
  if (kd.size() != 4 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      td.size() != 3 || !std::equal(td.begin(), td.end(), v.dimensions().begin()) ||
      td[1] != kd[2] || td[2] != kd[3] || slots.element_count() != static_cast<size_t>(td[0]))
    return ffi::Error::InvalidArgument("kv_write_cpu: shapes do not match");
  if (k.element_type() != k_cache.element_type() || v.element_type() != k_cache.element_type() ||
      v_cache.element_type() != k_cache.element_type() ||
      k_out->element_type() != k_cache.element_type())
    return ffi::Error::InvalidArgument("kv_write_cpu: k, v and the caches' types differ");
  const int64_t num_slots = kd[0] * kd[1];
  const size_t row = k.size_bytes() / std::max<int64_t>(td[0], 1);  // one token's Hkv x D
  const ffi::AnyBuffer* caches[2] = {&k_cache, &v_cache};
  const ffi::AnyBuffer* rows[2] = {&k, &v};
  char* outs[2] = {static_cast<char*>(k_out->untyped_data()),
                   static_cast<char*>(v_out->untyped_data())};
  for (int i = 0; i < 2; ++i) {
    if (outs[i] != caches[i]->untyped_data())  // (not aliased: start from the old cache)
      std::memcpy(outs[i], caches[i]->untyped_data(), caches[i]->size_bytes());
    const char* from = static_cast<const char*>(rows[i]->untyped_data());
    for (int64_t t = 0; t < td[0]; ++t) {
      const int64_t slot = slots.typed_data()[t];
      if (slot < 0 || slot >= num_slots) continue;
      std::memcpy(outs[i] + slot * row, from + t * row, row);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferKvWriteCpu, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::AnyBuffer>());
