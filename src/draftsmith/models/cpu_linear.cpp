// Few-row float32 linear on the CPU (draftsmith.models.cpu_linear, `--weight-layout cpp`):
// y [..., N] = x [..., K] W[N, K]^T (+ b).
//
// A decode step has m = 1 row, a verify step m = k + 1, so the product is a read of W with a
// little arithmetic per weight. MKL's and oneDNN's GEMMs are made for many rows: on the AMD EPYC
// of BENCHMARKS.md (15g) the 211 GEMMs of a SmolLM2-135M step took 47 ms through MKL and 29 ms
// through oneDNN at one row, 21 ms here. The kernel streams W from memory once whatever m is:
// output rows in blocks of 8 (eight sequential streams of W per thread, prefetched ahead), each
// block multiplied with every row of x (x stays in L1) in tiles of 2 rows (a block's W is still
// in L1/L2 for the next tile), 16 accumulators of 16 lanes, summed across lanes by one
// transpose-and-add tree. W stays as the model holds it ([N, K], row-major): no packed copy.
// (Written first for the SPR's compiled verify steps, where it lost to inductor's GEMM template:
// BENCHMARKS.md 9t; the eager steps use it since 15g.)
//
// Every y[i, n] is the same sum in the same order (lane j holds k = j mod 16, the tree adds
// the lanes in a fixed order, the bias last) whatever m is and whichever tile row i sits in,
// so a verify step's rows are bitwise those of one-token steps over the same inputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#include "cpu_vec.h"

// Output rows per block (8 sequential streams of W per thread: on the SPR, 4 streams made a verify
// of 2 / 4 rows ~1.14x / 1.29x one row, 8 streams ~1.05x / 1.2x) and x rows per tile: 8 x 2 = the
// 16 accumulators one transpose tree sums.
constexpr int64_t kRowBlock = 8;
constexpr int64_t kTile = 2;
static_assert(kRowBlock * kTile == 16, "one hsum16 per block and tile");
// Bytes ahead of each W stream prefetched into L2 (none: a verify of 2 rows 1.25x one row, 512: 1.05-1.11x).
constexpr int64_t kPrefetch = 512;

// The first `n` floats of p, the rest zero.
inline v16f load_tail(const float* p, int64_t n) {
  float buf[16] = {0.f};
  std::memcpy(buf, p, n * sizeof(float));
  return load16(buf);
}

// y[t, n0 + r] for r < R (R <= kRowBlock) and the x rows xr[t], t < T; rows of W past R are
// computed on a repeat of the last valid one and never stored, and so are tile rows past `stored`.
template <int T>
inline void block_tile(const float* const* xr, int stored, const float* w, int64_t K, int64_t R, const float* bias,
                       float* y, int64_t ldy) {
  const float* wr[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) wr[r] = w + std::min(r, R - 1) * K;
  v16f acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = v16f{};
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    v16f wv[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(wr[r] + k) + kPrefetch, 0, 2);
      wv[r] = load16(wr[r] + k);
    }
    for (int t = 0; t < T; ++t) {
      const v16f xv = load16(xr[t] + k);
      for (int r = 0; r < kRowBlock; ++r) acc[t * kRowBlock + r] += xv * wv[r];
    }
  }
  if (K16 < K) {
    v16f wv[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) wv[r] = load_tail(wr[r] + K16, K - K16);
    for (int t = 0; t < T; ++t) {
      const v16f xv = load_tail(xr[t] + K16, K - K16);
      for (int r = 0; r < kRowBlock; ++r) acc[t * kRowBlock + r] += xv * wv[r];
    }
  }
  const v16f s = hsum16(acc);  // lane t * kRowBlock + r: row t of the tile, output row r
  for (int t = 0; t < stored; ++t)
    for (int64_t r = 0; r < R; ++r) y[t * ldy + r] = bias ? s[t * kRowBlock + r] + bias[r] : s[t * kRowBlock + r];
}

void rows_block(const float* x, int64_t m, int64_t ldx, const float* w, int64_t K, int64_t R, const float* bias,
                float* y, int64_t ldy) {
  for (int64_t i = 0; i < m; i += kTile) {
    const int left = static_cast<int>(std::min<int64_t>(kTile, m - i));
    const float* xr[kTile];
    for (int t = 0; t < kTile; ++t) xr[t] = x + (i + std::min(t, left - 1)) * ldx;
    float* yi = y + i * ldy;
    if (left == 1) block_tile<1>(xr, 1, w, K, R, bias, yi, ldy);
    else block_tile<kTile>(xr, left, w, K, R, bias, yi, ldy);
  }
}

}  // namespace

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear: float32 x and w");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              "small_linear: x [..., K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const at::Tensor xc = x.reshape({-1, w.size(1)}).contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor bc;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0) && b->scalar_type() == at::kFloat, "small_linear: b [N]");
    bc = b->contiguous();
  }
  const int64_t m = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty({m, N}, xc.options());
  if (m == 0 || N == 0) return y.view(shape);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // ~64 KB of W per task at least: a small projection stays on one thread
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / kRowBlock);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRowBlock;
      const int64_t R = std::min(kRowBlock, N - n0);
      rows_block(xp, m, K, wp + n0 * K, K, R, bp ? bp + n0 : nullptr, yp + n0, N);
    }
  });
  return y.view(shape);
}

TORCH_LIBRARY_FRAGMENT(draftsmith, lib) {  // a fragment: other sources and Python register draftsmith:: ops too
  lib.def("small_linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith, CPU, lib) { lib.impl("small_linear", &small_linear); }
