// RMSNorm of rows x [T, H] (float32 or bfloat16), optionally after adding a residual r:
// s = x + r (rounded to the rows' dtype, as the residual stream is held), then
// y = w * dtype(s * rsqrt(mean(s^2) + eps)), or with unit_offset (Gemma)
// y = dtype(s * rsqrt(...) * (1 + w)); every sum and product in float32, as
// jaxinfer/layers/norms.py computes it (and HF). One C++ call instead of XLA's three to five
// small fusions per norm (the sum of squares, the scale, the product, the residual add), of
// which XLA split the reduction over its thread pool: a hop between threads per norm.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Rows {
  const void* x;
  const void* r;  // nullptr: no residual
  const void* w;
  void* s;  // x + r (with a residual), else unused
  void* y;
  int64_t T, H;
  float eps;
  bool bf16, unit_offset;
};

template <bool Bf16>
void norm_rows(const Rows& a, int64_t t0, int64_t t1, float* buf) {
  using E = std::conditional_t<Bf16, uint16_t, float>;
  auto value = [](E e) -> float {
    if constexpr (Bf16) return jaxinfer_cpu::bf16_to_float(e); else return e;
  };
  auto store = [](float f) -> E {
    if constexpr (Bf16) return jaxinfer_cpu::float_to_bf16(f); else return f;
  };
  const int64_t H = a.H;
  const E* w = static_cast<const E*>(a.w);
  for (int64_t t = t0; t < t1; ++t) {
    const E* x = static_cast<const E*>(a.x) + t * H;
    E* y = static_cast<E*>(a.y) + t * H;
    // the row as float32 values of its dtype (with a residual: the rounded sum, stored)
    if (a.r != nullptr) {
      const E* r = static_cast<const E*>(a.r) + t * H;
      E* s = static_cast<E*>(a.s) + t * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        const E e = store(value(x[h]) + value(r[h]));
        s[h] = e;
        buf[h] = value(e);
      }
    } else {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) buf[h] = value(x[h]);
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t h = 0; h < H; ++h) ss += buf[h] * buf[h];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + a.eps);
    if (a.unit_offset) {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) y[h] = store(buf[h] * inv * (1.0f + value(w[h])));
    } else {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) y[h] = store(value(w[h]) * value(store(buf[h] * inv)));
    }
  }
}

void norm_range(const Rows& a, int64_t t0, int64_t t1) {
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(a.H));
  if (a.bf16)
    norm_rows<true>(a, t0, t1, buf.data());
  else
    norm_rows<false>(a, t0, t1, buf.data());
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer r,
                       ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> s,
                       ffi::Result<ffi::AnyBuffer> y, float eps, int64_t unit_offset) {
  auto xd = x.dimensions();
  const auto type = x.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("rms_norm_cpu: rows must be float32 or bfloat16");
  if (xd.size() != 2 || w.element_type() != type || w.element_count() != xd[1] ||
      y->element_type() != type || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "rms_norm_cpu: x [T, H], weight [H], y [T, H], one dtype");
  const bool residual = r.element_count() != 0;
  if (residual && (r.element_type() != type || r.element_count() != x.element_count() ||
                   s->element_type() != type || s->element_count() != x.element_count()))
    return ffi::Error::InvalidArgument("rms_norm_cpu: residual and sum must be shaped as x");
  Rows a;
  a.x = x.untyped_data();
  a.r = residual ? r.untyped_data() : nullptr;
  a.w = w.untyped_data();
  a.s = s->untyped_data();
  a.y = y->untyped_data();
  a.T = xd[0];
  a.H = xd[1];
  a.eps = eps;
  a.bf16 = type == ffi::DataType::BF16;
  a.unit_offset = unit_offset != 0;
  if (a.T == 0 || a.H == 0) return ffi::Error::Success();
  jaxinfer_cpu::run_rows(pool, a.T, a.H, [&](int64_t t0, int64_t t1) { norm_range(a, t0, t1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferRmsNormCpu, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("unit_offset"));
