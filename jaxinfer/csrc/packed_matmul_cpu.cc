// y [M, N] = x [M, K] @ W, with W pre-packed at load time into column panels
// [N / kNR, K, kNR] (float32): what XLA's CPU dot cannot be given, since a GEMM library packs
// its B operand again on every call. Decode steps multiply few rows (M = the batch) by every
// weight once per step, so the weights stream from memory once, panel by panel, while the
// rows of x stay in cache. Panels are shared out over XLA's intra-op thread pool (the calling
// thread works too and waits only for panels already claimed).
//
// bfloat16 models keep their weights bf16 in the same panels (half the bytes to stream); each
// widens exactly to float32 as it is loaded, so x, the sums and y stay float32. Where the CPU
// multiplies bf16 pairs (AMX tiles; vdpbf16ps without AMX), products of several rows round
// the rows to bf16 instead (a bf16 model's rows are bf16 values) and keep float32 sums.
//
// Quantized weights (int8, fp8 e4m3) use the same panels, one byte per weight, with float32
// scales per output column and group of input rows (and for GGUF's asymmetric blocks an
// offset): each 16 weights widen to floats as they are loaded, each group's sums are scaled
// as the group ends. A decode step then streams about a quarter of the bytes.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <sys/syscall.h>  // (arch_prctl: the AMX tile state, asked for once per process)
#include <unistd.h>
#endif

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_cpu::load16;
using jaxinfer_cpu::store16;
using jaxinfer_cpu::v16;

namespace {

constexpr int64_t kNR = 32;  // panel width (2 x 16 floats)
#if defined(JAXINFER_V16_PAIR)
// AVX2 only: 16 ymm registers, a v16 takes two. A block of MR rows holds 4 MR sums and the
// row's 4 weight vectors: 2 rows (8 FMAs per k in flight: the 4-cycle latency of 2 FMA ports
// covered); 1 row where group sums double the sums; no paired panels (4 MR sums each).
constexpr int64_t kMR = 2;  // rows per register block
constexpr int64_t kGroupMR = 1;  // ... with per-group scales
constexpr int kTwoSumsRows = 1;  // rows up to which odd k rows get their own sums
#else
constexpr int64_t kMR = 6;  // rows per register block
constexpr int64_t kGroupMR = 3;  // ... with per-group scales
constexpr int kTwoSumsRows = 2;
#endif

// A bfloat16 weight (bf16 models: half the bytes of float32 panels; each widens exactly to
// a float as it is loaded, and x and the sums stay float32).
struct Bf16 {
  uint16_t bits;
};

// One byte of an fp8 e4m3 (OCP "fn": no infinities) weight.
struct Fp8E4M3 {
  uint8_t bits;
};


// 4-bit weights (GGUF's Q4 types), two k rows in each byte row of a panel: byte c of row
// pair j holds column c's row 2j in its low nibble and row 2j + 1 in its high one, codes 0..15
// (the loader folds each tensor's lowest code into its offsets). The panel is [K / 2, kNR].
struct Nibbles {
  uint8_t bits;
};

template <typename W>
constexpr int64_t kRowsPerByteRow = 1;
template <>
constexpr int64_t kRowsPerByteRow<Nibbles> = 2;

// 16 columns of a row pair -> their row 2j (lo) and row 2j + 1 (hi) as floats.
inline void load_nibbles(const Nibbles* p, v16& lo, v16& hi) {
  const uint8_t* b = &p->bits;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  lo = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15))));
  hi = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)));
#elif defined(__AVX2__)
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m256i w0 = _mm256_cvtepu8_epi32(w), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(w, 8));
  const __m256i m = _mm256_set1_epi32(15);
  lo = jaxinfer_cpu::join(_mm256_cvtepi32_ps(_mm256_and_si256(w0, m)),
                          _mm256_cvtepi32_ps(_mm256_and_si256(w1, m)));
  hi = jaxinfer_cpu::join(_mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)),
                          _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4)));
#else
  float l[16], h[16];
  for (int c = 0; c < 16; ++c) {
    l[c] = static_cast<float>(b[c] & 15);
    h[c] = static_cast<float>(b[c] >> 4);
  }
  lo = load16(l);
  hi = load16(h);
#endif
}

inline v16 load_w(const float* p) { return load16(p); }

inline v16 load_w(const int8_t* p) { return jaxinfer_cpu::i8_to_float16x(p); }

inline v16 load_w(const Bf16* p) {
  return jaxinfer_cpu::bf16_to_float16x(reinterpret_cast<const uint16_t*>(p));
}

// (the loader clips fp8 weights to +-448: no NaN patterns)
inline v16 load_w(const Fp8E4M3* p) {
  return jaxinfer_cpu::e4m3_to_float16x(reinterpret_cast<const uint8_t*>(p));
}

// Bytes ahead of the k row being read that the first pass over a panel prefetches. A panel
// is one sequential stream, yet this machine's hardware prefetchers kept too few lines in
// flight for it: at one to eight decode rows the loop stalled on its weight loads, and int8
// panels (half a cache line per k row) streamed at 7 GB/s where float32 ones reached 24
// (benchmarks/cpu_matmul.py, packed int8 row; 18.5 GB/s with this and the two sets of sums).
constexpr int64_t kPrefetchAhead = 4096;

// Nta: prefetchnta, for a panel read once by a loop that moves little else through L1 (all
// of a product's rows in one register block: the decode of one to a few sequences). Paired
// steps on the Zen 5 VM, both ways round: batch 1 ~6.5% faster for bf16 panels, ~7% for GGUF
// 4-bit and ~6% for float32 (docs/cpu.md). Not where other rows' blocks reread the panel from
// cache, nor in the widening loops, whose stores push the lines out of L1 first (GGUF at 32
// rows ~4% slower).
template <bool Nta = false, typename W>
inline void prefetch_row(const W* row, int64_t k) {
  constexpr int64_t bytes = kNR * sizeof(W);  // 32 (int8, fp8) or 128 (float)
  const char* p = reinterpret_cast<const char*>(row) + kPrefetchAhead;
  const auto fetch = [](const char* a) {
    if constexpr (Nta) __builtin_prefetch(a, 0, 0);
    else jaxinfer_cpu::prefetch(a);
  };
  if constexpr (bytes >= 64) {
    for (int64_t b = 0; b < bytes; b += 64) fetch(p + b);
  } else {
    if ((k & (64 / bytes - 1)) == 0) fetch(p);
  }
}

// block's Stream: kCached (the panel is in cache), kStream (read from memory, prefetched
// ahead; later blocks reread it) or kStreamOnce (read from memory by this block alone).
constexpr int kCached = 0, kStream = 1, kStreamOnce = 2;

// The scales and offsets of the group kGroupsAhead groups after group g ([K / G, kNR] per
// panel, panels one after another; offset optional): a stream of their own beside the
// panel's, which the hardware prefetchers left to demand misses (at one row, a third of a
// GGUF product's samples were on the loads of a group's scales and offsets). Near a panel's
// end this fetches the next panel's first groups, as prefetch_row runs on into the next
// panel (a prefetch past the weights' end does not fault).
constexpr int64_t kGroupsAhead = 8;

inline void prefetch_groups(const float* scale, const float* offset, int64_t g) {
  const float* s = scale + (g + kGroupsAhead) * kNR;
  jaxinfer_cpu::prefetch(s);
  jaxinfer_cpu::prefetch(s + 16);
  if (offset != nullptr) {
    const float* o = offset + (g + kGroupsAhead) * kNR;
    jaxinfer_cpu::prefetch(o);
    jaxinfer_cpu::prefetch(o + 16);
  }
}

// t += the MR rows xr [MR, K] . the panel's rows [k0, k1) (one weight per value): with Two,
// the even rows' products go into t and the odd rows' into u, two chains of FMAs per sum where
// one row's products alone would wait on the FMA's latency (an odd last row goes into t).
template <int MR, int Stream, bool Two, typename W>
inline void sum_rows(const float* xr, const W* panel, int64_t K, int64_t k0, int64_t k1,
                     v16 (&t)[MR][2], v16 (&u)[MR][2]) {
  int64_t k = k0;
  if constexpr (Two) {
    for (; k + 1 < k1; k += 2) {
      if (Stream) prefetch_row<Stream == kStreamOnce>(panel + k * kNR, k);
      if (Stream) prefetch_row<Stream == kStreamOnce>(panel + (k + 1) * kNR, k + 1);
      const v16 b0 = load_w(panel + k * kNR), b1 = load_w(panel + k * kNR + 16);
      const v16 c0 = load_w(panel + (k + 1) * kNR), c1 = load_w(panel + (k + 1) * kNR + 16);
      for (int i = 0; i < MR; ++i) {
        const float a = xr[i * K + k], a2 = xr[i * K + k + 1];
        t[i][0] += a * b0;
        t[i][1] += a * b1;
        u[i][0] += a2 * c0;
        u[i][1] += a2 * c1;
      }
    }
  }
  for (; k < k1; ++k) {
    if (Stream) prefetch_row<Stream == kStreamOnce>(panel + k * kNR, k);
    const v16 b0 = load_w(panel + k * kNR), b1 = load_w(panel + k * kNR + 16);
    for (int i = 0; i < MR; ++i) {
      const float a = xr[i * K + k];
      t[i][0] += a * b0;
      t[i][1] += a * b1;
    }
  }
}

// rows [m0, m0 + MR) x panel `panel`: acc = x rows . panel, written to y. Quantized weights
// (scale set): the panel's K rows come in groups of G, each with a scale and (offset set)
// an offset per column, [K / G, kNR] from `scale` / `offset`: y = sum over groups of
// s_g * (x . q_g) + o_g * sum(x_g) (GGUF's d * q + m blocks; offset null: symmetric). One
// group (G = K, per-channel scales) accumulates as float weights do and scales at the end;
// several need a second set of accumulators, so the caller runs them with fewer rows (the
// two sets must stay in registers: with 256-bit vectors preferred, a v16 takes two).
template <int MR, int Stream, typename W>
inline void block(const float* x, const W* panel, const float* scale, const float* offset,
                  const float* xsum, int64_t G, float* y, int64_t m0, int64_t K, int64_t N, int64_t col0,
                  int64_t ncols) {
  v16 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = v16{};
  const float* xr = x + m0 * K;
  if constexpr (std::is_same_v<W, Nibbles>) {  // (always groups: GGUF's; G even)
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
      if (Stream) prefetch_groups(scale, offset, g);
      // (the group's even and odd rows in sums of their own: one FMA into each per row pair,
      // four chains a row instead of two, each also waiting on a multiply and an add)
      v16 t[MR][2], u[MR][2];
      for (int i = 0; i < MR; ++i) t[i][0] = t[i][1] = u[i][0] = u[i][1] = v16{};
      for (int64_t k = g0; k < g0 + G; k += 2) {
        const Nibbles* r = panel + (k / 2) * kNR;
        if (Stream) prefetch_row<Stream == kStreamOnce>(r, k / 2);
        v16 l0, h0, l1, h1;
        load_nibbles(r, l0, h0);
        load_nibbles(r + 16, l1, h1);
        for (int i = 0; i < MR; ++i) {
          const float a = xr[i * K + k], a2 = xr[i * K + k + 1];
          t[i][0] += a * l0;
          t[i][1] += a * l1;
          u[i][0] += a2 * h0;
          u[i][1] += a2 * h1;
        }
      }
      const v16 s0 = load16(scale + g * kNR), s1 = load16(scale + g * kNR + 16);
      for (int i = 0; i < MR; ++i) {
        acc[i][0] += (t[i][0] + u[i][0]) * s0;
        acc[i][1] += (t[i][1] + u[i][1]) * s1;
      }
      if (offset != nullptr) {
        const v16 o0 = load16(offset + g * kNR), o1 = load16(offset + g * kNR + 16);
        for (int i = 0; i < MR; ++i) {
          const float xs = xsum[(m0 + i) * (K / G) + g];
          acc[i][0] += xs * o0;
          acc[i][1] += xs * o1;
        }
      }
    }
  } else if (scale == nullptr || (G == K && offset == nullptr)) {
    v16 odd[MR][2];  // (few rows: two sets of sums, for the FMA's latency)
    for (int i = 0; i < MR; ++i) odd[i][0] = odd[i][1] = v16{};
    sum_rows<MR, Stream, MR <= kTwoSumsRows>(xr, panel, K, 0, K, acc, odd);
    for (int i = 0; i < MR; ++i) {
      acc[i][0] += odd[i][0];
      acc[i][1] += odd[i][1];
    }
    if (scale != nullptr) {
      const v16 s0 = load16(scale), s1 = load16(scale + 16);
      for (int i = 0; i < MR; ++i) {
        acc[i][0] *= s0;
        acc[i][1] *= s1;
      }
    }
  } else {
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
      if (Stream) prefetch_groups(scale, offset, g);
      v16 t[MR][2], u[MR][2];  // (even and odd rows apart, as for 4-bit codes)
      for (int i = 0; i < MR; ++i) t[i][0] = t[i][1] = u[i][0] = u[i][1] = v16{};
      sum_rows<MR, Stream, true>(xr, panel, K, g0, g0 + G, t, u);
      const v16 s0 = load16(scale + g * kNR), s1 = load16(scale + g * kNR + 16);
      for (int i = 0; i < MR; ++i) {
        acc[i][0] += (t[i][0] + u[i][0]) * s0;
        acc[i][1] += (t[i][1] + u[i][1]) * s1;
      }
      if (offset != nullptr) {  // + o_g * sum of the group's x (from cache: x is small)
        const v16 o0 = load16(offset + g * kNR), o1 = load16(offset + g * kNR + 16);
        for (int i = 0; i < MR; ++i) {
          const float xs = xsum[(m0 + i) * (K / G) + g];
          acc[i][0] += xs * o0;
          acc[i][1] += xs * o1;
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* yr = y + (m0 + i) * N + col0;
    if (ncols == kNR) {
      store16(yr, acc[i][0]);
      store16(yr + 16, acc[i][1]);
    } else {  // the last, partial panel
      float tmp[kNR];
      store16(tmp, acc[i][0]);
      store16(tmp + 16, acc[i][1]);
      std::memcpy(yr, tmp, ncols * sizeof(float));
    }
  }
}

// Per-group scales and offsets of the weights: [panels, K / G, kNR] each (offset optional).
struct Groups {
  const float* scale = nullptr;
  const float* offset = nullptr;
  int64_t G = 0;  // rows per group
  // With offsets: each row of x's sum over each group of inputs, [M, K / G], computed once per
  // product (the offset term is o_g * that sum; summing it per panel, a scalar chain of G
  // adds, cost a one-row GGUF product more than its weights).
  const float* xsum = nullptr;
};

// Rows from which a quantized panel is widened to floats once (scales and offsets applied)
// and multiplied as a float panel, instead of widening it again for every block of rows:
// prefill-sized products are compute-bound, and the widening would cost as much as the FMAs.
constexpr int64_t kWidenRows = 12;

#if defined(JAXINFER_V16_PAIR)
// AVX2 only, float panels from kHalfRows rows: 6 rows x one half of a panel (16 columns, 2
// ymm): 12 sums, 2 weight vectors and a broadcast in the 16 registers, each k row's weights
// (from L2) feeding 12 FMAs (the 2-row blocks: 8 FMAs per 4 vectors loaded; 41 GFLOP/s a
// core at 32 rows, the FMA ports half idle).
constexpr int64_t kHalfRows = 8;

template <int MR>
inline void block_half(const float* x, const float* panel, float* y, int64_t m0, int64_t K,
                       int64_t N, int64_t col0, int64_t ncols, int h) {
  using jaxinfer_cpu::v8;
  using jaxinfer_cpu::v8u;
  const int64_t n = std::min<int64_t>(16, ncols - 16 * h);
  if (n <= 0) return;
  v8 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = v8{};
  const float* xr = x + m0 * K;
  const float* b = panel + 16 * h;
  for (int64_t k = 0; k < K; ++k) {
    const v8 b0 = *reinterpret_cast<const v8u*>(b + k * kNR);
    const v8 b1 = *reinterpret_cast<const v8u*>(b + k * kNR + 8);
    for (int i = 0; i < MR; ++i) {
      const float a = xr[i * K + k];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* yr = y + (m0 + i) * N + col0 + 16 * h;
    float tmp[16];
    float* out = n == 16 ? yr : tmp;
    *reinterpret_cast<v8u*>(out) = acc[i][0];
    *reinterpret_cast<v8u*>(out + 8) = acc[i][1];
    if (n < 16) std::memcpy(yr, tmp, n * sizeof(float));
  }
}
#endif

// All M rows x one panel (its first column col0, ncols of them).
template <typename W>
void panel_rows(const float* x, const W* panel, const float* sc, const float* of,
                const float* xs, int64_t G, float* y, int64_t M, int64_t K, int64_t N, int64_t col0, int64_t ncols,
                bool from_memory = true) {
  // The first block of rows reads the panel from memory (and prefetches ahead); the others
  // find it in cache.
  const bool groups = std::is_same_v<W, Nibbles> || (sc != nullptr && (G < K || of != nullptr));
#if defined(JAXINFER_V16_PAIR)
  if constexpr (std::is_same_v<W, float>) {
    if (sc == nullptr && M >= kHalfRows) {
      int64_t m0 = 0;
      if (from_memory) {  // (the first 2 rows stream the panel into cache)
        block<kMR, kStream>(x, panel, sc, of, xs, G, y, 0, K, N, col0, ncols);
        m0 = kMR;
      }
      for (; m0 + 6 <= M; m0 += 6)
        for (int h = 0; h < 2; ++h) block_half<6>(x, panel, y, m0, K, N, col0, ncols, h);
      for (; m0 + kMR <= M; m0 += kMR)
        block<kMR, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);
      if (m0 < M) block<1, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);
      return;
    }
  }
#endif
  const int64_t mr = groups ? kGroupMR : kMR;
  int64_t m0 = 0;
  if (M >= mr && !from_memory) {
    for (; m0 + kMR <= M; m0 += kMR)
      block<kMR, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);
  } else if (M >= mr) {
    if (groups) block<kGroupMR, kStream>(x, panel, sc, of, xs, G, y, 0, K, N, col0, ncols);
    else block<kMR, kStream>(x, panel, sc, of, xs, G, y, 0, K, N, col0, ncols);
    m0 = mr;
    if (groups) {
      for (; m0 + kGroupMR <= M; m0 += kGroupMR)
        block<kGroupMR, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);
    } else {
      for (; m0 + kMR <= M; m0 += kMR)
        block<kMR, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);
    }
  }
  const bool stream = m0 == 0 && from_memory;  // (then all M rows are in this one block)
  switch (M - m0) {
#define JAXINFER_REST(R)                                                           \
  case R:                                                                          \
    if (stream) block<R, kStreamOnce>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols); \
    else block<R, kCached>(x, panel, sc, of, xs, G, y, m0, K, N, col0, ncols);       \
    break;
    JAXINFER_REST(1)
    JAXINFER_REST(2)
    JAXINFER_REST(3)
    JAXINFER_REST(4)
    JAXINFER_REST(5)
#undef JAXINFER_REST
    default: break;
  }
}

template <typename W>
void panel_product(const float* x, const W* w, const Groups& gr, float* y, int64_t M,
                   int64_t K, int64_t N, int64_t p) {
  const W* panel = w + p * (K / kRowsPerByteRow<W>) * kNR;
  const int64_t col0 = p * kNR, ncols = std::min(kNR, N - col0);
  const int64_t per = gr.G > 0 ? (K / gr.G) * kNR : 0;  // a panel's scales
  const float* sc = gr.scale ? gr.scale + p * per : nullptr;
  const float* of = gr.offset ? gr.offset + p * per : nullptr;
  if constexpr (std::is_same_v<W, Bf16>) {
    if (M >= kWidenRows) {  // (as quantized panels below: widened once, then float panels)
      thread_local std::vector<float> buf;
      buf.resize(static_cast<size_t>(K * kNR));
      for (int64_t k = 0; k < K; ++k) {
        prefetch_row(panel + k * kNR, k);
        store16(buf.data() + k * kNR, load_w(panel + k * kNR));
        store16(buf.data() + k * kNR + 16, load_w(panel + k * kNR + 16));
      }
      panel_rows<float>(x, buf.data(), nullptr, nullptr, nullptr, 0, y, M, K, N, col0, ncols,
                        false);
      return;
    }
  } else if constexpr (!std::is_same_v<W, float>) {
    if (sc != nullptr && M >= kWidenRows) {
      thread_local std::vector<float> buf;
      buf.resize(static_cast<size_t>(K * kNR));
      if constexpr (std::is_same_v<W, Nibbles>) {
        for (int64_t k = 0; k < K; k += 2) {
          const Nibbles* r = panel + (k / 2) * kNR;
          prefetch_row(r, k / 2);
          const int64_t g = k / gr.G;
          const v16 s0 = load16(sc + g * kNR), s1 = load16(sc + g * kNR + 16);
          const v16 o0 = of ? load16(of + g * kNR) : v16{}, o1 = of ? load16(of + g * kNR + 16)
                                                                    : v16{};
          v16 l0, h0, l1, h1;
          load_nibbles(r, l0, h0);
          load_nibbles(r + 16, l1, h1);
          store16(buf.data() + k * kNR, l0 * s0 + o0);
          store16(buf.data() + k * kNR + 16, l1 * s1 + o1);
          store16(buf.data() + (k + 1) * kNR, h0 * s0 + o0);
          store16(buf.data() + (k + 1) * kNR + 16, h1 * s1 + o1);
        }
      } else {
        for (int64_t k = 0; k < K; ++k) {
          prefetch_row(panel + k * kNR, k);
          const int64_t g = k / gr.G;
          v16 w0 = load_w(panel + k * kNR) * load16(sc + g * kNR);
          v16 w1 = load_w(panel + k * kNR + 16) * load16(sc + g * kNR + 16);
          if (of != nullptr) {
            w0 += load16(of + g * kNR);
            w1 += load16(of + g * kNR + 16);
          }
          store16(buf.data() + k * kNR, w0);
          store16(buf.data() + k * kNR + 16, w1);
        }
      }
      panel_rows<float>(x, buf.data(), nullptr, nullptr, nullptr, 0, y, M, K, N, col0, ncols, false);
      return;
    }
  }
  panel_rows(x, panel, sc, of, gr.xsum, gr.G, y, M, K, N, col0, ncols);
}

// Float panels p and p + 1 (both full) x rows [m0, m0 + MR): 4 vectors of columns per row
// (MR x 4 accumulators), so each broadcast of an x value feeds 4 FMAs instead of 2 (prefill-
// sized products 5-13% faster than one panel at a time: benchmarks/cpu_matmul.py).
// Fetch (pf set): the passes after a pair's first find it in cache and are compute-bound;
// they bring the next pair's lines into L2 meanwhile (PF lines per k row for the first
// pf_rows rows), so its first pass does not wait on memory (at 32 rows the first pass took
// as long as the four after it).
template <int MR, int PF = 0>
inline void block_pair(const float* x, const float* pa, const float* pb, float* y, int64_t m0,
                       int64_t K, int64_t N, int64_t col0, const float* pf = nullptr,
                       int64_t pf_rows = 0) {
  v16 acc[MR][4];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = v16{};
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF > 0) {  // (no branch: one in this loop made GCC spill the accumulators)
      const float* f = pf + std::min(k, pf_rows - 1) * (PF * 16);
      for (int l = 0; l < PF; ++l) jaxinfer_cpu::prefetch_l2(f + l * 16);
    }
    const v16 b0 = load16(pa + k * kNR), b1 = load16(pa + k * kNR + 16);
    const v16 b2 = load16(pb + k * kNR), b3 = load16(pb + k * kNR + 16);
    for (int i = 0; i < MR; ++i) {
      const float a = xr[i * K + k];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
      acc[i][2] += a * b2;
      acc[i][3] += a * b3;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* yr = y + (m0 + i) * N + col0;
    for (int j = 0; j < 4; ++j) store16(yr + 16 * j, acc[i][j]);
  }
}

// Rows from which float panels are multiplied in pairs (block_pair; never with AVX2 only).
#if defined(JAXINFER_V16_PAIR)
constexpr int64_t kPairRows = INT64_MAX;
#else
constexpr int64_t kPairRows = 12;
#endif

// block_pair<MR, PF> for MR rows (4 to 6) and PF fetched lines per k row (0, 1, 2 or 4).
inline void pair_pass(int mr, int pf_kind, const float* x, const float* pa, const float* pb,
                      float* y, int64_t m0, int64_t K, int64_t N, int64_t col0, const float* pf,
                      int64_t pf_rows) {
#define JAXINFER_PASS(MR)                                                          \
  case MR:                                                                         \
    switch (pf_kind) {                                                             \
      case 0: block_pair<MR>(x, pa, pb, y, m0, K, N, col0); break;                 \
      case 1: block_pair<MR, 1>(x, pa, pb, y, m0, K, N, col0, pf, pf_rows); break; \
      case 2: block_pair<MR, 2>(x, pa, pb, y, m0, K, N, col0, pf, pf_rows); break; \
      default: block_pair<MR, 4>(x, pa, pb, y, m0, K, N, col0, pf, pf_rows); break; \
    }                                                                              \
    break;
  switch (mr) {
    JAXINFER_PASS(4)
    JAXINFER_PASS(5)
    JAXINFER_PASS(6)
    default: break;
  }
#undef JAXINFER_PASS
}

#if (defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)) || \
    (defined(__AVX512BF16__) && defined(__AVX512BW__))
#define JAXINFER_BF16_PAIRS 1  // bf16 panel pairs multiplied as bf16 pairs (AMX or vdpbf16ps)
// x [M, K] float -> [M, Kp] bf16 rows (Kp >= K, the caller zero-pads), rounded to nearest even.
inline void x_to_bf16(const float* x, uint16_t* out, int64_t M, int64_t K, int64_t Kp) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    uint16_t* o = out + m * Kp;
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(o + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                     _mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k))));
#endif
    for (; k < K; ++k) o[k] = jaxinfer_cpu::float_to_bf16(xr[k]);
  }
}

// Two k rows r0, r1 of a panel (32 bf16 columns each) -> their k pairs, columns 0-15 (lo)
// and 16-31 (hi): [column][2] each.
inline void k_pairs(__m512i r0, __m512i r1, __m512i& lo, __m512i& hi) {
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
  lo = _mm512_permutex2var_epi16(r0, first, r1);
  hi = _mm512_permutex2var_epi16(r0, _mm512_add_epi16(first, _mm512_set1_epi16(16)), r1);
}

// Panels a, b (bf16 [K, 32] each, K even) -> buf [Kp / 2][64][2] (k pairs past K zero).
inline void interleave_pair(const uint16_t* a, const uint16_t* b, uint16_t* buf, int64_t K,
                            int64_t Kp) {
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    for (int half = 0; half < 2; ++half) {  // columns 0-31 from a, 32-63 from b
      const uint16_t* src = (half == 0 ? a : b) + 2 * k2 * kNR;
      __m512i lo, hi;
      k_pairs(_mm512_loadu_si512(src), _mm512_loadu_si512(src + kNR), lo, hi);
      uint16_t* d = buf + (k2 * 64 + half * 32) * 2;
      _mm512_storeu_si512(d, lo);
      _mm512_storeu_si512(d + 32, hi);
    }
  }
  std::memset(buf + (K / 2) * 128, 0, (Kp - K) / 2 * 128 * sizeof(uint16_t));
}

#endif

#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__)) && defined(JAXINFER_BF16_PAIRS)
// bf16 panels from kDotRows rows on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later,
// Intel Cooper Lake): vdpbf16ps multiplies 16 columns by a k pair per instruction, 32
// products where an FMA does 16, at an FMA's rate on Zen 4 (one 512-bit instruction a cycle
// either way). The pair of panels is interleaved by k pairs (as for AMX: [K / 2][64][2]) and
// the rows converted to bf16 once per product ([M][K]); each product of two bf16 values is
// exact in float32 and the sums stay float32, so a bf16 model's rows (bf16 values already)
// get what float32 FMAs on the widened weights give them, up to the order of the adds.
constexpr bool kBf16Dot = true;
constexpr int64_t kDotRows = 6;

// 16 sums rounded to bf16 (to nearest even, a NaN kept a quiet NaN: float_to_bf16's rule,
// so a result is the same bits whether rounded here or by `finish`) -> dst[0, 16).
inline void store_bf16(uint16_t* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(  // (on the bits: -ffast-math assumes no NaN)
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

// A block's MR x 64 sums -> y's columns col0 .. +63 of rows m0 .. (yb set: rounded into the
// bf16 result yb instead).
template <int MR>
inline void store_block(const __m512 (&acc)[MR][4], float* y, uint16_t* yb, int64_t m0,
                        int64_t N, int64_t col0) {
  for (int i = 0; i < MR; ++i) {
    if (yb != nullptr) {
      uint16_t* yr = yb + (m0 + i) * N + col0;
      for (int j = 0; j < 4; ++j) store_bf16(yr + 16 * j, acc[i][j]);
    } else {
      float* yr = y + (m0 + i) * N + col0;
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(yr + 16 * j, acc[i][j]);
    }
  }
}

// acc[i] += x row i's k pair k2 . the pair's 64 columns (w0..w3: 16 columns x 2 each).
template <int MR>
inline void dot_rows(__m512 (&acc)[MR][4], const uint16_t* xr, int64_t K, int64_t k2,
                     __m512i w0, __m512i w1, __m512i w2, __m512i w3) {
  for (int i = 0; i < MR; ++i) {
    uint32_t two;  // x[m, 2 k2] (low half) and x[m, 2 k2 + 1]
    std::memcpy(&two, xr + i * K + 2 * k2, 4);
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(two)));
    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, reinterpret_cast<__m512bh>(w0));
    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, reinterpret_cast<__m512bh>(w1));
    acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, reinterpret_cast<__m512bh>(w2));
    acc[i][3] = _mm512_dpbf16_ps(acc[i][3], a, reinterpret_cast<__m512bh>(w3));
  }
}

// Rows [m0, m0 + MR) of xb (bf16 [M, K]) x the interleaved pair -> y's (or yb's) columns
// col0 .. +63. Meanwhile the first pf_k pairs of k rows each fetch a cache line from pf on into
// L2 (the next pair's panels, for its first pass: see dot_pair).
template <int MR>
inline void dot_pair_block(const uint16_t* xb, const uint16_t* buf, float* y, uint16_t* yb,
                           int64_t m0, int64_t K, int64_t N, int64_t col0,
                           const char* pf = nullptr, int64_t pf_k = 0) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* xr = xb + m0 * K;
  // The fetching steps in chunks of 16: their lines first, then their products. (A prefetch
  // inside the products' loop made GCC keep the sums in memory there, 24 stores to the stack
  // per step; now they are stored and reloaded once per chunk.)
  constexpr int64_t kChunk = 16;
  const int64_t fetching = std::min(K / 2, (pf_k + kChunk - 1) / kChunk * kChunk);
  int64_t k2 = 0;
  for (; k2 < fetching; k2 += kChunk) {
    for (int64_t j = k2; j < std::min(pf_k, k2 + kChunk); ++j)
      jaxinfer_cpu::prefetch_l2(pf + 64 * j);
    for (int64_t kk = k2; kk < std::min(K / 2, k2 + kChunk); ++kk) {
      const uint16_t* b = buf + kk * 128;
      dot_rows<MR>(acc, xr, K, kk, _mm512_loadu_si512(b), _mm512_loadu_si512(b + 32),
                   _mm512_loadu_si512(b + 64), _mm512_loadu_si512(b + 96));
    }
  }
  for (; k2 < K / 2; ++k2) {
    const uint16_t* b = buf + k2 * 128;
    dot_rows<MR>(acc, xr, K, k2, _mm512_loadu_si512(b), _mm512_loadu_si512(b + 32),
                 _mm512_loadu_si512(b + 64), _mm512_loadu_si512(b + 96));
  }
  store_block<MR>(acc, y, yb, m0, N, col0);
}

// The first pass over a pair: rows [0, MR) x panels a, b (bf16 [K, 32] each, read from
// memory, fetched kPrefetchAhead bytes ahead), interleaving them into buf as it goes (for the
// passes after it) while their products run: the memory streams under the products instead
// of before them. Up to 11 rows it takes 6 (a decode batch of 6 is then one pass, one of 8 a
// pass of 6 and one of 2), else 4 (bigger products fetch the next pair in the passes after).
template <int MR>
inline void dot_pair_first(const uint16_t* xb, const uint16_t* a, const uint16_t* b,
                           uint16_t* buf, float* y, uint16_t* yb, int64_t K, int64_t N,
                           int64_t col0) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const uint16_t* sa = a + 2 * k2 * kNR;
    const uint16_t* sb = b + 2 * k2 * kNR;
    for (int l = 0; l < 2; ++l) {  // (two k rows of a panel: 128 bytes)
      jaxinfer_cpu::prefetch(reinterpret_cast<const char*>(sa) + kPrefetchAhead + 64 * l);
      jaxinfer_cpu::prefetch(reinterpret_cast<const char*>(sb) + kPrefetchAhead + 64 * l);
    }
    __m512i w0, w1, w2, w3;
    k_pairs(_mm512_loadu_si512(sa), _mm512_loadu_si512(sa + kNR), w0, w1);
    k_pairs(_mm512_loadu_si512(sb), _mm512_loadu_si512(sb + kNR), w2, w3);
    uint16_t* d = buf + k2 * 128;
    _mm512_storeu_si512(d, w0);
    _mm512_storeu_si512(d + 32, w1);
    _mm512_storeu_si512(d + 64, w2);
    _mm512_storeu_si512(d + 96, w3);
    dot_rows<MR>(acc, xb, K, k2, w0, w1, w2, w3);
  }
  store_block<MR>(acc, y, yb, 0, N, col0);
}

// All M rows (M >= kDotRows) x panels a, b: the first pass interleaves them into buf,
// the other rows follow in passes of up to 6 (shared evenly). Those passes read the pair from
// cache and, when there are 4 or more of them (from 23 rows), fetch the next_lines cache lines
// from `next` on (the pair this thread multiplies next) into L2, one line per pair of k rows,
// so that its first pass does not wait on memory (at 32 rows the products ran 5-8% faster;
// fewer passes, fetching more lines each, were no faster at 8 and 16 rows).
static_assert(kDotRows >= 6, "dot_pair's first pass takes 6 rows below 12");

inline void dot_pair(const uint16_t* xb, const uint16_t* a, const uint16_t* b, uint16_t* buf,
                     float* y, uint16_t* yb, int64_t M, int64_t K, int64_t N, int64_t col0,
                     const char* next = nullptr, int64_t next_lines = 0) {
  const int64_t first = M < 12 ? 6 : 4;
  if (first == 6) dot_pair_first<6>(xb, a, b, buf, y, yb, K, N, col0);
  else dot_pair_first<4>(xb, a, b, buf, y, yb, K, N, col0);
  const int64_t rest = M - first, passes = (rest + 5) / 6;
  if (passes < 4) next = nullptr;  // (a pair's 2 K lines over 4 or more passes' K / 2 steps)
  int64_t m0 = first, fetched = 0;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t mr = first + (rest * (pass + 1)) / passes - m0;
    const int64_t pf_k = next == nullptr ? 0 : std::min(next_lines - fetched, K / 2);
    const char* pf = next + 64 * fetched;
    fetched += pf_k;
    switch (mr) {
      case 1: dot_pair_block<1>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
      case 2: dot_pair_block<2>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
      case 3: dot_pair_block<3>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
      case 4: dot_pair_block<4>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
      case 5: dot_pair_block<5>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
      default: dot_pair_block<6>(xb, buf, y, yb, m0, K, N, col0, pf, pf_k); break;
    }
    m0 += mr;
  }
}
#else
constexpr bool kBf16Dot = false;
constexpr int64_t kDotRows = 0;
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
// bf16 panels from kAmxRows rows on CPUs with AMX: the tile unit multiplies a 16 x 32 block of
// bf16 rows by a 32 x 16 block of weights (as 16 k pairs x 16 columns x 2) into 16 x 16 float32
// sums per instruction. Exact as float32 FMAs on the widened weights would be for a bf16
// model's rows (bf16 values already; other rows are rounded to nearest): each product of two
// bf16 values is exact in float32 and the sums are float32. A pair of panels is interleaved by
// k pairs ([K / 2][64 columns][2], zero pairs past K up to a multiple of 32), the rows of x
// converted once per product ([M up to 16s][K up to 32s], zero padded).
constexpr bool kAmx = true;
constexpr int64_t kAmxRows = 16;

// Linux hands out the tile state only to processes that ask (once per process).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All rows x the interleaved pair (columns col0 .. col0 + 63 of y): 32 rows x 32 columns per
// pass of four accumulator tiles (0-3), two row tiles (4, 5) and two weight tiles (6, 7).
inline void amx_pair(const uint16_t* xb, const uint16_t* buf, float* y, int64_t M, int64_t Kp,
                     int64_t N, int64_t col0, float* scratch) {
  const int64_t Mp = (M + 15) / 16 * 16;
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    const bool two = m0 + 16 < Mp;
    for (int half = 0; half < 2; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k0 = 0; k0 < Kp; k0 += 32) {
        const uint16_t* b = buf + (k0 / 2) * 128 + half * 64;  // 16 k pairs, 256 B apart
        _tile_loadd(6, b, 256);
        _tile_loadd(7, b + 32, 256);
        _tile_loadd(4, xb + m0 * Kp + k0, Kp * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, xb + (m0 + 16) * Kp + k0, Kp * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, scratch, 32 * 4);
      _tile_stored(1, scratch + 16, 32 * 4);
      if (two) {
        _tile_stored(2, scratch + 16 * 32, 32 * 4);
        _tile_stored(3, scratch + 16 * 32 + 16, 32 * 4);
      }
      const int64_t rows = std::min<int64_t>(32, M - m0);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + (m0 + r) * N + col0 + half * 32, scratch + r * 32, 32 * sizeof(float));
    }
  }
}
#else
constexpr bool kAmx = false;
constexpr int64_t kAmxRows = 0;
#endif

// Panel bytes a worker claims at least (work()'s claim). GGUF 4-bit panels of SmolLM2 are
// 9 KiB: claimed one at a time, the two threads took turns along small products (a 576 x 576
// projection is 18 panels), so each claim began a stream of its own with no prefetch ahead of
// it, and the other thread's prefetches ran into it. At 64 KiB a GGUF batch-1 step took
// ~0.88 of the time (claims of 32 KiB: ~0.92, 256 KiB: worse again, the threads finishing
// apart); float32 and bf16 panels (37-73 KiB) claim one at a time as before. Products of
// fewer than kWidenRows rows only: at 32 rows a GGUF step ran ~3% slower with it (a small
// projection went to one thread where its FMAs, not its bytes, take the time).
constexpr int64_t kMinClaimBytes = 64 << 10;

template <typename W>
struct Shared {
  const float* x;
  const W* w;
  Groups groups;  // quantized weights' scales (else scale == nullptr)
  std::vector<float> xsum;  // (groups.xsum's storage)
  std::vector<uint16_t> xbf;  // (xb's storage where x is converted here)
  // bf16 panel pairs with AMX or vdpbf16ps: x as bf16 [Mp, Kp], else null; yb: the bf16 result
  // the vdpbf16ps pairs round their sums into (a bf16 y given as it is), else null
  const uint16_t* xb = nullptr;
  uint16_t* yb = nullptr;
  int64_t Kp = 0;
  float* y;
  int64_t M, K, N, panels, per_task;
  int64_t min_claim = 1;  // panels a claim takes at least (claim())
  int64_t workers = 1;  // the caller and its helpers
  bool pairs = false;  // full panels in pairs (from kPairRows rows; vdpbf16ps: kDotRows)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename W>
void work(Shared<W>& sh) {
  // Paired panels claim their chunks one ahead, so the pairs' cached passes can fetch the next
  // one's first pair; the others claim a chunk when they start it (no chunk held idle).
  // The others take chunks that shrink as the panels run out (a share of what is left, at
  // most per_task, at least one panel): the workers then finish within about a panel of each
  // other. (Fixed chunks of a twelfth of the panels left the last one alone for up to a
  // chunk: ~8% of a one-row product's time on average, which is bandwidth-bound.)
  constexpr bool kFloatPanels = std::is_same_v<W, float> || std::is_same_v<W, Bf16>;
  const bool ahead = sh.pairs;
  int64_t size = sh.per_task;  // (the chunk claim() returned last)
  auto claim = [&] {
    if (ahead) return sh.next.fetch_add(sh.per_task, std::memory_order_relaxed);
    int64_t at = sh.next.load(std::memory_order_relaxed);
    do {
      size = std::clamp<int64_t>((sh.panels - at) / (2 * sh.workers), sh.min_claim,
                                 sh.per_task);
    } while (at < sh.panels &&
             !sh.next.compare_exchange_weak(at, at + size, std::memory_order_relaxed));
    return at;
  };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
  struct Tiles {  // this thread's tile registers, configured for amx_pair while it works
    explicit Tiles(bool on) : on(on) {
      if (!on) return;
      TileConfig c;
      for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
      }
      _tile_loadconfig(&c);
    }
    ~Tiles() {
      if (on) _tile_release();
    }
    bool on;
  } tiles(std::is_same_v<W, Bf16> && sh.xb != nullptr);
#endif
  int64_t first = claim();
  while (first < sh.panels) {
    const int64_t after = ahead ? claim() : sh.panels;
    const int64_t last = std::min(sh.panels, first + (ahead ? sh.per_task : size));
    int64_t p = first;
    if constexpr (kFloatPanels) {
      if (sh.pairs) {  // pairs of full panels
        const int64_t panel = sh.K * kNR;
        const int64_t lines = 2 * panel * sizeof(W) / 64;  // a pair's cache lines
        // ceil(M / 6) passes of 4 to 6 rows, the rows shared out evenly (a pass of 6 and a
        // 2-row tail per panel left FMAs waiting on their 4 accumulators' latency).
        const int64_t passes = (sh.M + kMR - 1) / kMR, cached_passes = passes - 1;
        const int64_t per_k = cached_passes >= 4 ? 1 : cached_passes >= 2 ? 2 : 4;  // (4 K)
        for (; p + 1 < last && (p + 2) * kNR <= sh.N; p += 2) {
          const float* pa;
          const float* pf = nullptr;
          const int64_t q = p + 2 < last ? p + 2 : after;  // the pair to fetch
          if constexpr (std::is_same_v<W, Bf16> && kAmx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
            if (sh.xb != nullptr) {
              thread_local std::vector<uint16_t> ibuf;
              thread_local std::vector<float> scratch(32 * 32);
              ibuf.resize(static_cast<size_t>(sh.Kp * 64));
              const uint16_t* src = reinterpret_cast<const uint16_t*>(sh.w + p * panel);
              interleave_pair(src, src + panel, ibuf.data(), sh.K, sh.Kp);
              if (q < sh.panels) {  // the next pair into L2 while this one is multiplied
                const char* nx = reinterpret_cast<const char*>(sh.w + q * panel);
                const int64_t n_lines = std::min(lines, (sh.panels - q) * panel * 2 / 64);
                for (int64_t l = 0; l < n_lines; ++l) jaxinfer_cpu::prefetch_l2(nx + 64 * l);
              }
              amx_pair(sh.xb, ibuf.data(), sh.y, sh.M, sh.Kp, sh.N, p * kNR,
                       scratch.data());
              continue;
            }
#endif
          }
          if constexpr (std::is_same_v<W, Bf16> && kBf16Dot) {
#if defined(JAXINFER_BF16_PAIRS)
            if (sh.xb != nullptr) {
              thread_local std::vector<uint16_t> ibuf;
              ibuf.resize(static_cast<size_t>(sh.K * 64));
              const uint16_t* src = reinterpret_cast<const uint16_t*>(sh.w + p * panel);
              const char* nx = q < sh.panels ? reinterpret_cast<const char*>(sh.w + q * panel)
                                             : nullptr;
              const int64_t n_lines =
                  nx == nullptr ? 0 : std::min(lines, (sh.panels - q) * panel * 2 / 64);
              dot_pair(sh.xb, src, src + panel, ibuf.data(), sh.y, sh.yb, sh.M, sh.K, sh.N,
                       p * kNR, nx, n_lines);
              continue;
            }
#endif
          }
          if constexpr (std::is_same_v<W, Bf16>) {
            // bf16: the pair widened once into float panels (in L2 already: the previous
            // pair's passes fetched it), then multiplied as float panels are.
            thread_local std::vector<float> buf;
            buf.resize(static_cast<size_t>(2 * panel));
            const W* src = sh.w + p * panel;
            for (int64_t r = 0; r < 2 * sh.K; ++r) {
              prefetch_row(src + r * kNR, r);
              store16(buf.data() + r * kNR, load_w(src + r * kNR));
              store16(buf.data() + r * kNR + 16, load_w(src + r * kNR + 16));
            }
            pa = buf.data();
          } else {
            pa = sh.w + p * panel;
          }
          // (the fetch walks the next pair's bytes 64 at a time, whatever W is)
          if (q < sh.panels) pf = reinterpret_cast<const float*>(sh.w + q * panel);
          const int64_t pf_lines =
              std::min(lines, (sh.panels - q) * panel * static_cast<int64_t>(sizeof(W)) / 64);
          int64_t m0 = 0;
          for (int64_t pass = 0; pass < passes; ++pass) {
            const int64_t mr = (sh.M * (pass + 1)) / passes - m0;  // (4 to 6 from M = 12)
            const int64_t done = pass == 0 ? pf_lines : (pass - 1) * sh.K * per_k;
            const int64_t rows = (pf_lines - done + per_k - 1) / per_k;  // k rows fetching
            const int pf_kind = pf == nullptr || done >= pf_lines ? 0 : static_cast<int>(per_k);
            pair_pass(static_cast<int>(mr), pf_kind, sh.x, pa, pa + panel, sh.y, m0, sh.K, sh.N,
                      p * kNR, pf == nullptr ? nullptr : pf + done * 16, rows);
            m0 += mr;
          }
        }
      }
    }
    for (; p < last; ++p)
      panel_product(sh.x, sh.w, sh.groups, sh.y, sh.M, sh.K, sh.N, p);
    sh.done.fetch_add(last - first, std::memory_order_release);
    first = ahead ? after : claim();
  }
}

// A bf16 product [M, K] x [K, N] that runs on vdpbf16ps pairs of full panels throughout
// (no panel of its own, no AMX). Only such a product takes a bf16 model's rows as they are
// and rounds its sums into a bf16 result itself (PackedMatmul's xb, yb): the other paths
// multiply float32 rows into float32 sums.
inline bool dot_pairs(int64_t M, int64_t K) {  // (bf16 panels on vdpbf16ps pairs at all)
  return kBf16Dot && M >= kDotRows && K % 2 == 0;
}

inline bool bf16_pairs_only(int64_t M, int64_t K, int64_t N) {
  return dot_pairs(M, K) && N % (2 * kNR) == 0;
}

// y = x @ w. xb, yb (only where bf16_pairs_only): x's rows as bf16 values (x unused) and a
// bf16 result (y unused), as the vdpbf16ps pairs read and write them.
template <typename W>
ffi::Error PackedMatmul(ffi::ThreadPool& pool, const float* x, const W* w, const Groups& groups,
                        float* y, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                        ffi::Span<const int64_t> yd, const uint16_t* xb = nullptr,
                        uint16_t* yb = nullptr) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR ||
      wd[1] * kRowsPerByteRow<W> != xd[1] ||
      yd[0] != xd[0] || yd[1] > wd[0] * kNR || yd[1] <= (wd[0] - 1) * kNR)
    return ffi::Error::InvalidArgument("packed_matmul_cpu: shapes do not match");
  if ((xb != nullptr || yb != nullptr) &&
      !(std::is_same_v<W, Bf16> && bf16_pairs_only(xd[0], xd[1], yd[1])))
    return ffi::Error::Internal("packed_matmul_cpu: bf16 rows or result off the bf16 pairs");
  auto sh = std::make_shared<Shared<W>>();
  sh->x = x;
  sh->w = w;
  sh->groups = groups;
  sh->y = y;
  sh->M = xd[0];
  sh->K = xd[1];
  sh->N = yd[1];
  sh->panels = wd[0];
  if (sh->M == 0 || sh->N == 0) return ffi::Error::Success();
  if (groups.offset != nullptr && sh->M < kWidenRows) {  // (widened panels add offsets)
    const int64_t K = sh->K, G = groups.G, KG = K / G;
    sh->xsum.resize(static_cast<size_t>(sh->M * KG));
    for (int64_t m = 0; m < sh->M; ++m)
      for (int64_t g = 0; g < KG; ++g) {
        float t = 0.0f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) t += x[m * K + k];
        sh->xsum[m * KG + g] = t;
      }
    sh->groups.xsum = sh->xsum.data();
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<W, Bf16>) {
    if (sh->M >= kAmxRows && sh->K % 2 == 0 && amx_permitted()) {
      sh->Kp = (sh->K + 31) / 32 * 32;
      sh->xbf.assign(static_cast<size_t>((sh->M + 15) / 16 * 16 * sh->Kp), 0);
      x_to_bf16(x, sh->xbf.data(), sh->M, sh->K, sh->Kp);
      sh->xb = sh->xbf.data();
    }
  }
#endif
#if defined(JAXINFER_BF16_PAIRS)
  if constexpr (std::is_same_v<W, Bf16> && kBf16Dot) {
    if (dot_pairs(sh->M, sh->K)) {  // (vdpbf16ps pairs from fewer rows than AMX's)
      sh->Kp = sh->K;
      if (xb != nullptr) {
        sh->xb = xb;
      } else {
        sh->xbf.resize(static_cast<size_t>(sh->M * sh->K));
        x_to_bf16(x, sh->xbf.data(), sh->M, sh->K, sh->K);
        sh->xb = sh->xbf.data();
      }
      sh->yb = yb;
      sh->pairs = true;
    }
  }
#endif
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, Bf16>)
    if (sh->M >= kPairRows) sh->pairs = true;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread: balance without much contention on the counter.
  sh->per_task = std::max<int64_t>(1, sh->panels / (4 * (threads + 1)));
  if (sh->M < kWidenRows) {  // (streaming the weights; from there on the rows' FMAs decide)
    const int64_t panel_bytes = (sh->K / kRowsPerByteRow<W>) * kNR * sizeof(W);
    sh->min_claim = std::max<int64_t>(1, kMinClaimBytes / panel_bytes);
    sh->per_task = std::max(sh->per_task, sh->min_claim);
  }
  if (sh->pairs)  // (whole pairs of panels per chunk)
    sh->per_task = std::max<int64_t>(2, sh->per_task + sh->per_task % 2);
  const int64_t chunks = (sh->panels + sh->per_task - 1) / sh->per_task;
  const int64_t helpers = jaxinfer_cpu::helper_count(threads, chunks);
  sh->workers = 1 + helpers;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work(*sh); });
  work(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->panels) std::this_thread::yield();
  return ffi::Error::Success();
}

// The products run in float32, but x and y may each be float32 or bfloat16: a bf16 model's
// rows widen exactly here, and its results round to nearest even here, as XLA's converts
// around the call did. Each of those converts was a fusion of its own, run as a separate
// thunk, so a batch-1 step of SmolLM2 paid ~150 of them.
// A product that runs on bf16 pairs throughout (bf16_pairs_only) skips both: it reads bf16 rows
// as they are and rounds its sums into a bf16 y itself. At prefill sizes the widened rows,
// their bf16 copy and the float32 result were three more passes over buffers of up to tens
// of MB (one of them on the calling thread alone).
struct FloatIO {
  const float* x = nullptr;  // [M, K]: x's data, or xbuf (null where xb is x's data)
  float* y = nullptr;        // [M, N]: y's data, or ybuf (rounded into y by `finish`)
  const uint16_t* xb = nullptr;  // a bf16 x's data, given to the bf16 pairs as it is
  uint16_t* yb = nullptr;        // a bf16 y's data, rounded into by the bf16 pairs
  std::vector<float> xbuf, ybuf;
};

// Whether a product of x's rows [M, K] by the bf16 panels w into y [M, N] runs on bf16 pairs
// throughout (shapes not checked here: those that do not match fail later anyway).
bool pairs_only(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                const ffi::Result<ffi::AnyBuffer>& y, int64_t k_per_row = 1) {
  auto xd = x.dimensions(), yd = y->dimensions();
  return w.element_type() == ffi::DataType::BF16 && xd.size() == 2 && yd.size() == 2 &&
         bf16_pairs_only(xd[0], xd[1] / k_per_row, yd[1]);
}

// io for x and y (direct_x, direct_y: the product runs on bf16 pairs throughout, so bf16 rows
// and a bf16 result are handed over as they are).
ffi::Error float_io(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                    ffi::Result<ffi::AnyBuffer>& y, FloatIO& io, const char* who,
                    bool direct_x = false, bool direct_y = false) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(who) + ": x and y must be 2-D");
  if (direct_x && x.element_type() == ffi::DataType::BF16) {
    io.xb = static_cast<const uint16_t*>(x.untyped_data());
  } else if (x.element_type() == ffi::DataType::F32) {
    io.x = static_cast<const float*>(x.untyped_data());
  } else if (x.element_type() == ffi::DataType::BF16) {
    const int64_t K = xd[1];
    const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data());
    io.xbuf.resize(static_cast<size_t>(std::max<int64_t>(1, xd[0] * K)));
    float* dst = io.xbuf.data();
    jaxinfer_cpu::run_rows(pool, xd[0], K, [&](int64_t m0, int64_t m1) {
#pragma omp simd
      for (int64_t i = m0 * K; i < m1 * K; ++i) dst[i] = jaxinfer_cpu::bf16_to_float(src[i]);
    });
    io.x = dst;
  } else {
    return ffi::Error::InvalidArgument(std::string(who) + ": x must be float32 or bfloat16");
  }
  if (y->element_type() == ffi::DataType::F32) {
    io.y = static_cast<float*>(y->untyped_data());
  } else if (direct_y && y->element_type() == ffi::DataType::BF16) {
    io.yb = static_cast<uint16_t*>(y->untyped_data());
  } else if (y->element_type() == ffi::DataType::BF16) {
    io.ybuf.resize(static_cast<size_t>(std::max<int64_t>(1, yd[0] * yd[1])));
    io.y = io.ybuf.data();
  } else {
    return ffi::Error::InvalidArgument(std::string(who) + ": y must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// A product that succeeded into io.y: rounded into a bfloat16 y (a float32 y holds it).
ffi::Error finish(ffi::ThreadPool& pool, ffi::Error e, const FloatIO& io,
                  ffi::Result<ffi::AnyBuffer>& y) {
  if (e.failure() || io.ybuf.empty()) return e;
  const int64_t N = y->dimensions()[1];
  const float* src = io.ybuf.data();
  uint16_t* dst = static_cast<uint16_t*>(y->untyped_data());
  jaxinfer_cpu::run_rows(pool, y->dimensions()[0], N, [&](int64_t m0, int64_t m1) {
#pragma omp simd
    for (int64_t i = m0 * N; i < m1 * N; ++i) dst[i] = jaxinfer_cpu::float_to_bf16(src[i]);
  });
  return e;
}

// Float panels: w float32 or bfloat16 [P, K, kNR].
ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> y) {
  FloatIO io;
  const bool direct = pairs_only(x, w, y);
  if (auto e = float_io(pool, x, y, io, "packed_matmul_cpu", direct, direct); e.failure())
    return e;
  if (w.element_type() == ffi::DataType::F32)
    return finish(pool, PackedMatmul(pool, io.x, static_cast<const float*>(w.untyped_data()),
                                     Groups{}, io.y, x.dimensions(), w.dimensions(),
                                     y->dimensions()), io, y);
  if (w.element_type() == ffi::DataType::BF16)
    return finish(pool, PackedMatmul(pool, io.x, static_cast<const Bf16*>(w.untyped_data()),
                                     Groups{}, io.y, x.dimensions(), w.dimensions(),
                                     y->dimensions(), io.xb, io.yb), io, y);
  return ffi::Error::InvalidArgument("packed_matmul_cpu: weights must be float32 or bfloat16");
}

// f(the weights typed: const int8_t* or const Fp8E4M3*), or an error naming `who`.
template <typename F>
ffi::Error with_quantized(const ffi::AnyBuffer& w, const char* who, F f) {
  if (w.element_type() == ffi::DataType::S8)
    return f(static_cast<const int8_t*>(w.untyped_data()));
  if (w.element_type() == ffi::DataType::F8E4M3FN)
    return f(static_cast<const Fp8E4M3*>(w.untyped_data()));
  return ffi::Error::InvalidArgument(std::string(who) + ": weights must be int8 or fp8 e4m3");
}

// Quantized panels: w int8 or fp8 e4m3 [P, K, kNR], or 4-bit (uint8 [P, K / 2, kNR], see
// Nibbles); scale float32 [P, K / G, kNR] (one group of all K rows: per-channel); offset the
// same shape, or [0] (none).
ffi::Error QuantMatmul(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> xd,
                       const ffi::AnyBuffer& w, const ffi::Buffer<ffi::F32>& scale,
                       const ffi::Buffer<ffi::F32>& offset, float* y,
                       ffi::Span<const int64_t> yd) {
  auto wd = w.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  if (wd.size() != 3 || sd.size() != 3 || sd[0] != wd[0] || sd[2] != kNR || sd[1] < 1 ||
      wd[1] % sd[1] != 0)
    return ffi::Error::InvalidArgument(
        "quant_matmul_cpu: scale must be [panels, K / G, 32] with G dividing K");
  const bool has_offset = offset.element_count() != 0;
  if (has_offset && (od.size() != 3 || !std::equal(od.begin(), od.end(), sd.begin())))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: offset must be shaped as scale");
  Groups gr;
  gr.scale = scale.typed_data();
  gr.offset = has_offset ? offset.typed_data() : nullptr;
  if (w.element_type() == ffi::DataType::U8) {  // 4-bit: [P, K / 2, kNR] byte rows
    gr.G = 2 * wd[1] / sd[1];
    if ((2 * wd[1]) % sd[1] != 0 || gr.G % 2 != 0)
      return ffi::Error::InvalidArgument("quant_matmul_cpu: 4-bit groups must be even");
    return PackedMatmul(pool, x, static_cast<const Nibbles*>(w.untyped_data()), gr, y, xd,
                        wd, yd);
  }
  gr.G = wd[1] / sd[1];
  return with_quantized(w, "quant_matmul_cpu", [&](auto* wq) {
    return PackedMatmul(pool, x, wq, gr, y, xd, wd, yd);
  });
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                           ffi::Result<ffi::AnyBuffer> y) {
  FloatIO io;
  if (auto e = float_io(pool, x, y, io, "quant_matmul_cpu"); e.failure()) return e;
  return finish(pool, QuantMatmul(pool, io.x, x.dimensions(), w, scale, offset, io.y,
                                  y->dimensions()), io, y);
}

// Gated forms, for a gated MLP's down projection: x holds the gate-up product's rows
// [M, 2K] (the gate's K columns, then the up's) and the rows multiplied are act(gate) * up
// [M, K] (act: 1 silu, 2 gelu, tanh form), made here in float32 (from a bf16 model's bf16
// product as it is, a float32 one's float32). XLA compiled that product
// as a fusion of its own between the two kernels, split over its pool (both threads of a
// 2-core VM); without it bf16 and Q4 decode steps ran 2-5% faster, float32 ones within 2%
// (results/cpu_gated_mlp_ab_zen5.json).
constexpr int64_t kActSilu = 1, kActGeluTanh = 2;

// A gate-up product's value as float32: float32, or bf16 widened exactly.
inline float gate_value(const float* p, int64_t k) { return p[k]; }
inline float gate_value(const uint16_t* p, int64_t k) { return jaxinfer_cpu::bf16_to_float(p[k]); }

// act(gate) * up of rows [m0, m1) of x [M, 2K] (float32, or a bf16 model's bf16 product read
// as it is: half the bytes of this memory-bound pass) into out [M, K].
template <typename In>
void gate_rows(const In* x, float* out, int64_t m0, int64_t m1, int64_t K, int64_t act) {
  for (int64_t m = m0; m < m1; ++m) {
    const In* g = x + m * 2 * K;
    const In* u = g + K;
    float* o = out + m * K;
    // (exp's arguments are clamped where the result no longer moves: under -ffast-math an
    // infinite exp turned the reciprocal's refinement into NaN)
    if (act == kActSilu) {
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float gk = gate_value(g, k);
        o[k] = gk / (1.0f + std::exp(std::min(-gk, 80.0f))) * gate_value(u, k);
      }
    } else {  // gelu, tanh form: 0.5 (1 + tanh(z)) = 1 - 1 / (exp(2 z) + 1)
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float gk = gate_value(g, k);
        const float z = 0.7978845608028654f * (gk + 0.044715f * gk * gk * gk);
        const float e = std::exp(2.0f * std::clamp(z, -20.0f, 20.0f));
        o[k] = gk * (1.0f - 1.0f / (e + 1.0f)) * gate_value(u, k);
      }
    }
  }
}

// Values of act(gate) * up one thread makes alone: an exp each, ~10x a norm's work per
// value (with run_rows' 2^16, 32 rows of SmolLM2's 1536 ran on one thread while the other
// waited, ~10% of a decode-32 down projection).
constexpr int64_t kGateSerialValues = int64_t{1} << 12;

// act(gate) * up of all M rows into out (many rows shared out over the pool).
template <typename In>
void gate_all(ffi::ThreadPool& pool, const In* x, float* out, int64_t M, int64_t K,
              int64_t act) {
  jaxinfer_cpu::run_rows(
      pool, M, K, [&](int64_t m0, int64_t m1) { gate_rows(x, out, m0, m1, K, act); },
      kGateSerialValues);
}

// act(gate) * up of all M rows rounded to bf16 into out [M, K] (the bits x_to_bf16 makes of
// gate_all's rows), for a product on bf16 pairs throughout.
template <typename In>
void gate_all_bf16(ffi::ThreadPool& pool, const In* x, uint16_t* out, int64_t M, int64_t K,
                   int64_t act) {
#if defined(JAXINFER_BF16_PAIRS)
  jaxinfer_cpu::run_rows(
      pool, M, K,
      [&](int64_t m0, int64_t m1) {
        thread_local std::vector<float> row;
        row.resize(static_cast<size_t>(K));
        for (int64_t m = m0; m < m1; ++m) {
          gate_rows(x + m * 2 * K, row.data(), 0, 1, K, act);
          x_to_bf16(row.data(), out + m * K, 1, K, K);
        }
      },
      kGateSerialValues);
#else
  (void)pool, (void)x, (void)out, (void)M, (void)K, (void)act;
  std::abort();  // (no bf16 pairs in this build: bf16_pairs_only is false)
#endif
}

// x [M, 2K] (float32 or bfloat16), y -> (the gated rows [M, K] in `rows`, their dimensions
// in `dims`, where y's product goes in `io`), or an error. direct (the product runs on bf16
// pairs throughout): the rows are made bf16 in `rows_bf` instead and a bf16 y taken as it
// is. (rows: not zeroed first, every value is written)
ffi::Error gated_input(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                       ffi::Result<ffi::AnyBuffer>& y, int64_t act, FloatIO& io,
                       std::unique_ptr<float[]>& rows, int64_t dims[2], bool direct = false,
                       std::unique_ptr<uint16_t[]>* rows_bf = nullptr) {
  auto xd = x.dimensions();
  if (act != kActSilu && act != kActGeluTanh)
    return ffi::Error::InvalidArgument("gated matmul: act must be 1 (silu) or 2 (gelu_tanh)");
  if (xd.size() != 2 || xd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("gated matmul: x must be [M, 2K]");
  // (a bf16 x is read as it is: io.xb)
  if (auto e = float_io(pool, x, y, io, "gated matmul", true, direct); e.failure()) return e;
  dims[0] = xd[0];
  dims[1] = xd[1] / 2;
  const size_t n = static_cast<size_t>(std::max<int64_t>(1, dims[0] * dims[1]));
  if (direct) {
    rows_bf->reset(new uint16_t[n]);
    if (io.xb != nullptr)
      gate_all_bf16(pool, io.xb, rows_bf->get(), dims[0], dims[1], act);
    else
      gate_all_bf16(pool, io.x, rows_bf->get(), dims[0], dims[1], act);
  } else {
    rows.reset(new float[n]);
    if (io.xb != nullptr)
      gate_all(pool, io.xb, rows.get(), dims[0], dims[1], act);
    else
      gate_all(pool, io.x, rows.get(), dims[0], dims[1], act);
  }
  return ffi::Error::Success();
}

ffi::Error GatedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> y, int64_t act) {
  FloatIO io;
  std::unique_ptr<float[]> rows;
  std::unique_ptr<uint16_t[]> rows_bf;
  int64_t dims[2];
  if (auto e = gated_input(pool, x, y, act, io, rows, dims, pairs_only(x, w, y, 2), &rows_bf);
      e.failure())
    return e;
  const ffi::Span<const int64_t> xd(dims, 2);
  if (w.element_type() == ffi::DataType::F32)
    return finish(pool, PackedMatmul(pool, rows.get(),
                                     static_cast<const float*>(w.untyped_data()), Groups{},
                                     io.y, xd, w.dimensions(), y->dimensions()), io, y);
  if (w.element_type() == ffi::DataType::BF16)
    return finish(pool, PackedMatmul(pool, rows.get(),
                                     static_cast<const Bf16*>(w.untyped_data()), Groups{},
                                     io.y, xd, w.dimensions(), y->dimensions(), rows_bf.get(),
                                     io.yb), io, y);
  return ffi::Error::InvalidArgument("gated_matmul_cpu: weights must be float32 or bfloat16");
}

ffi::Error GatedQuantMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                                ffi::Result<ffi::AnyBuffer> y, int64_t act) {
  FloatIO io;
  std::unique_ptr<float[]> rows;
  int64_t dims[2];
  if (auto e = gated_input(pool, x, y, act, io, rows, dims); e.failure()) return e;
  return finish(pool, QuantMatmul(pool, rows.get(), ffi::Span<const int64_t>(dims, 2), w,
                                  scale, offset, io.y, y->dimensions()), io, y);
}

// Grouped (mixture-of-experts) form: rows of x sorted by expert, group_sizes[e] rows for
// expert e, each multiplied by its own packed weight w[e] [P, K, kNR]. A work item is one
// (expert with rows, panel) pair, so each used expert's weights stream once and an expert
// no row chose is never read. Quantized experts: int8 / fp8 panels with scales per expert
// [E, P, K / G, kNR].
template <typename W>
struct GroupedShared {
  const float* x;
  const W* w;
  const float* scale = nullptr;  // [E, P, KB, kNR] (quantized) or nullptr
  int64_t KB = 0;
  float* y;
  int64_t K, N, panels;
  std::unique_ptr<int64_t[]> start, rows, expert;  // per used expert: first row, rows, id
  int64_t items, per_task;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename W>
void grouped_work(GroupedShared<W>& sh) {
  for (;;) {
    const int64_t first = sh.next.fetch_add(sh.per_task, std::memory_order_relaxed);
    if (first >= sh.items) return;
    const int64_t last = std::min(sh.items, first + sh.per_task);
    for (int64_t it = first; it < last; ++it) {
      const int64_t g = it / sh.panels, p = it % sh.panels, e = sh.expert[g];
      Groups gr;
      if (sh.scale != nullptr) {
        gr.scale = sh.scale + e * sh.panels * sh.KB * kNR;
        gr.G = sh.K / sh.KB;
      }
      panel_product(sh.x + sh.start[g] * sh.K, sh.w + e * sh.panels * sh.K * kNR, gr,
                    sh.y + sh.start[g] * sh.N, sh.rows[g], sh.K, sh.N, p);
    }
    sh.done.fetch_add(last - first, std::memory_order_release);
  }
}

template <typename W>
ffi::Error GroupedMatmul(ffi::ThreadPool& pool, const float* x, const W* w, const float* scale,
                         int64_t KB, const int32_t* gs, float* y, ffi::Span<const int64_t> xd,
                         ffi::Span<const int64_t> wd, ffi::Span<const int64_t> gd,
                         ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || wd.size() != 4 || gd.size() != 1 || yd.size() != 2 || wd[3] != kNR ||
      wd[2] != xd[1] || gd[0] != wd[0] || yd[0] != xd[0] || yd[1] > wd[1] * kNR ||
      yd[1] <= (wd[1] - 1) * kNR)
    return ffi::Error::InvalidArgument("grouped_matmul_cpu: shapes do not match");
  const int64_t M = xd[0], E = wd[0];
  auto sh = std::make_shared<GroupedShared<W>>();
  sh->x = x;
  sh->w = w;
  sh->scale = scale;
  sh->KB = KB;
  sh->y = y;
  sh->K = xd[1];
  sh->N = yd[1];
  sh->panels = wd[1];
  sh->start.reset(new int64_t[E]);
  sh->rows.reset(new int64_t[E]);
  sh->expert.reset(new int64_t[E]);
  int64_t used = 0, row = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (gs[e] < 0 || gs[e] > M - row)
      return ffi::Error::InvalidArgument("grouped_matmul_cpu: group sizes out of range");
    if (gs[e] > 0) {
      sh->start[used] = row;
      sh->rows[used] = gs[e];
      sh->expert[used++] = e;
    }
    row += gs[e];
  }
  if (row < M)  // rows past the groups belong to no expert: zeros, never stale memory
    std::memset(sh->y + row * sh->N, 0, (M - row) * sh->N * sizeof(float));
  sh->items = used * sh->panels;
  if (sh->items == 0 || sh->N == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  sh->per_task = std::max<int64_t>(1, sh->items / (4 * (threads + 1)));
  const int64_t chunks = (sh->items + sh->per_task - 1) / sh->per_task;
  const int64_t helpers = jaxinfer_cpu::helper_count(threads, chunks);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { grouped_work(*sh); });
  grouped_work(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->items) std::this_thread::yield();
  return ffi::Error::Success();
}

// Float experts: w float32 or bfloat16 [E, P, K, kNR].
ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto run = [&](auto* wt) {
    return GroupedMatmul(pool, x.typed_data(), wt, nullptr, 0, group_sizes.typed_data(),
                         y->typed_data(), x.dimensions(), w.dimensions(),
                         group_sizes.dimensions(), y->dimensions());
  };
  if (w.element_type() == ffi::DataType::F32)
    return run(static_cast<const float*>(w.untyped_data()));
  if (w.element_type() == ffi::DataType::BF16)
    return run(static_cast<const Bf16*>(w.untyped_data()));
  return ffi::Error::InvalidArgument("grouped_matmul_cpu: weights must be float32 or bfloat16");
}

// Quantized experts: w int8 / fp8 e4m3 [E, P, K, kNR], scale float32 [E, P, K / G, kNR].
ffi::Error GroupedQuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                  ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                                  ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto wd = w.dimensions(), sd = scale.dimensions();
  if (wd.size() != 4 || sd.size() != 4 || sd[0] != wd[0] || sd[1] != wd[1] || sd[3] != kNR ||
      sd[2] < 1 || wd[2] % sd[2] != 0)
    return ffi::Error::InvalidArgument(
        "grouped_quant_matmul_cpu: scale must be [E, panels, K / G, 32] with G dividing K");
  return with_quantized(w, "grouped_quant_matmul_cpu", [&](auto* wq) {
    return GroupedMatmul(pool, x.typed_data(), wq, scale.typed_data(), sd[2],
                         group_sizes.typed_data(), y->typed_data(), x.dimensions(), wd,
                         group_sizes.dimensions(), y->dimensions());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGroupedMatmulCpu, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGroupedQuantMatmulCpu, GroupedQuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantMatmulCpu, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGatedMatmulCpu, GatedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGatedQuantMatmulCpu, GatedQuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmulCpu, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
