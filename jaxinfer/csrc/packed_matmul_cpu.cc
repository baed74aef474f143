// y [M, N] = x [M, K] @ W, with W pre-packed at load time into column panels
// [N / kNR, K, kNR] (float32): what XLA's CPU dot cannot be given, since a GEMM library packs
// its B operand again on every call. Decode steps multiply few rows (M = the batch) by every
// weight once per step, so the weights stream from memory once, panel by panel, while the
// rows of x stay in cache. Panels are shared out over XLA's intra-op thread pool (the calling
// thread works too and waits only for panels already claimed).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_cpu::load16;
using jaxinfer_cpu::store16;
using jaxinfer_cpu::v16;

namespace {

constexpr int64_t kNR = 32;  // panel width (2 x 16 floats)
constexpr int64_t kMR = 6;  // rows per register block

// rows [m0, m0 + MR) x panel `panel`: acc = x rows . panel, written to y.
template <int MR>
inline void block(const float* x, const float* panel, float* y, int64_t m0, int64_t K, int64_t N,
                  int64_t col0, int64_t ncols) {
  v16 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = v16{};
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    const v16 b0 = load16(panel + k * kNR), b1 = load16(panel + k * kNR + 16);
    for (int i = 0; i < MR; ++i) {
      const float a = xr[i * K + k];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
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

void panel_product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                   int64_t p) {
  const float* panel = w + p * K * kNR;
  const int64_t col0 = p * kNR, ncols = std::min(kNR, N - col0);
  int64_t m0 = 0;
  for (; m0 + kMR <= M; m0 += kMR) block<kMR>(x, panel, y, m0, K, N, col0, ncols);
  switch (M - m0) {
    case 1: block<1>(x, panel, y, m0, K, N, col0, ncols); break;
    case 2: block<2>(x, panel, y, m0, K, N, col0, ncols); break;
    case 3: block<3>(x, panel, y, m0, K, N, col0, ncols); break;
    case 4: block<4>(x, panel, y, m0, K, N, col0, ncols); break;
    case 5: block<5>(x, panel, y, m0, K, N, col0, ncols); break;
    default: break;
  }
}

struct Shared {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, panels, per_task;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void work(Shared& sh) {
  for (;;) {
    const int64_t first = sh.next.fetch_add(sh.per_task, std::memory_order_relaxed);
    if (first >= sh.panels) return;
    const int64_t last = std::min(sh.panels, first + sh.per_task);
    for (int64_t p = first; p < last; ++p) panel_product(sh.x, sh.w, sh.y, sh.M, sh.K, sh.N, p);
    sh.done.fetch_add(last - first, std::memory_order_release);
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR || wd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] > wd[0] * kNR || yd[1] <= (wd[0] - 1) * kNR)
    return ffi::Error::InvalidArgument("packed_matmul_cpu: shapes do not match");
  auto sh = std::make_shared<Shared>();
  sh->x = x.typed_data();
  sh->w = w.typed_data();
  sh->y = y->typed_data();
  sh->M = xd[0];
  sh->K = xd[1];
  sh->N = yd[1];
  sh->panels = wd[0];
  if (sh->M == 0 || sh->N == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread: balance without much contention on the counter.
  sh->per_task = std::max<int64_t>(1, sh->panels / (4 * (threads + 1)));
  const int64_t chunks = (sh->panels + sh->per_task - 1) / sh->per_task;
  const int64_t helpers = jaxinfer_cpu::helper_count(threads, chunks);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work(*sh); });
  work(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->panels) std::this_thread::yield();
  return ffi::Error::Success();
}

// Grouped (mixture-of-experts) form: rows of x sorted by expert, group_sizes[e] rows for
// expert e, each multiplied by its own packed weight w[e] [P, K, kNR]. A work item is one
// (expert with rows, panel) pair, so each used expert's weights stream once and an expert
// no row chose is never read.
struct GroupedShared {
  const float* x;
  const float* w;
  float* y;
  int64_t K, N, panels;
  std::unique_ptr<int64_t[]> start, rows, expert;  // per used expert: first row, rows, id
  int64_t items, per_task;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void grouped_work(GroupedShared& sh) {
  for (;;) {
    const int64_t first = sh.next.fetch_add(sh.per_task, std::memory_order_relaxed);
    if (first >= sh.items) return;
    const int64_t last = std::min(sh.items, first + sh.per_task);
    for (int64_t it = first; it < last; ++it) {
      const int64_t g = it / sh.panels, p = it % sh.panels;
      panel_product(sh.x + sh.start[g] * sh.K, sh.w + sh.expert[g] * sh.panels * sh.K * kNR,
                    sh.y + sh.start[g] * sh.N, sh.rows[g], sh.K, sh.N, p);
    }
    sh.done.fetch_add(last - first, std::memory_order_release);
  }
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), gd = group_sizes.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || gd.size() != 1 || yd.size() != 2 || wd[3] != kNR ||
      wd[2] != xd[1] || gd[0] != wd[0] || yd[0] != xd[0] || yd[1] > wd[1] * kNR ||
      yd[1] <= (wd[1] - 1) * kNR)
    return ffi::Error::InvalidArgument("grouped_matmul_cpu: shapes do not match");
  const int64_t M = xd[0], E = wd[0];
  auto sh = std::make_shared<GroupedShared>();
  sh->x = x.typed_data();
  sh->w = w.typed_data();
  sh->y = y->typed_data();
  sh->K = xd[1];
  sh->N = yd[1];
  sh->panels = wd[1];
  sh->start.reset(new int64_t[E]);
  sh->rows.reset(new int64_t[E]);
  sh->expert.reset(new int64_t[E]);
  const int32_t* gs = group_sizes.typed_data();
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGroupedMatmulCpu, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmulCpu, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
