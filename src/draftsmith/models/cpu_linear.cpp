// Few-row float32 linear on the CPU (draftsmith.models.cpu_linear): y [M, N] = x [M, K] W [N, K]^T + b.
//
// A decode or verify step multiplies 1 to k + 1 rows by every weight: the step reads each weight
// once, and the product is bound by memory bandwidth, not arithmetic. MKL's and oneDNN's GEMMs
// are built for many rows and pay for packing, blocking and dispatch per call; on the AMD EPYC
// of BENCHMARKS.md a SmolLM2-135M step's Linear layers reached ~60% of a plain read of their
// weights through oneDNN (MKL less, and 1.4-2.2x dearer at 2-6 rows). Here each thread takes
// blocks of R weight rows [n, n + R) and computes their dot products with all M input rows in
// one pass over those weights, in R x M vector accumulators (R chosen per M to fit the vector
// registers), so M rows cost about what one does.
//
// Every output y[m, n] is summed in the same order whatever M, R and the thread split are (per
// vector lane over k in steps of the lane count, then the lanes, then the scalar tail), so a row
// computed in a verify step is bitwise the row a one-token step computes for the same input.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
// weight rows per block for M = 1..8 input rows: M * R accumulators + R weights + 1 input <= 32 registers
constexpr int kRows[9] = {0, 8, 8, 6, 6, 5, 4, 3, 3};
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kRows[9] = {0, 6, 4, 3, 3, 2, 2, 2, 1};  // 16 registers
#else  // portable: the compiler's own vectorization, if any
using Vec = float;
constexpr int kLanes = 1;
inline Vec vzero() { return 0.0f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec a) { return a; }
constexpr int kRows[9] = {0, 4, 4, 2, 2, 2, 2, 1, 1};
#endif

constexpr int kMaxRows = 8;  // input rows per pass over the weights

// y[m, r] for M input rows x (row stride ldx) and R weight rows w (row stride K), r in [0, R)
template <int M, int R>
inline void block(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, const float* b) {
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const Vec xv = vload(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = vsum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) s += x[m * ldx + k] * w[r * K + k];
      y[m * ldy + r] = b ? s + b[r] : s;
    }
  }
}

template <int M>
void all_rows(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y, int64_t ldy,
              const float* b) {
  constexpr int R = kRows[M];
  const int64_t blocks = (N + R - 1) / R;
  // ~32 KiB of weights per task at least: enough work per task that 2-16 threads all get some
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 13) / std::max<int64_t>(K * R, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n = t * R;
      if (n + R <= N) {
        block<M, R>(x, ldx, w + n * K, K, y + n, ldy, b ? b + n : nullptr);
      } else {  // the last, partial block: one weight row at a time (the same sums, see the top)
        for (int64_t j = n; j < N; ++j) block<M, 1>(x, ldx, w + j * K, K, y + j, ldy, b ? b + j : nullptr);
      }
    }
  });
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "small_linear: float32 only");
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "small_linear: x [..., K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "small_linear: bias [N] float32 expected");
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    const float* xm = xp + m0 * K;
    float* ym = yp + m0 * N;
    switch (std::min<int64_t>(kMaxRows, rows - m0)) {
      case 1: all_rows<1>(xm, K, wp, N, K, ym, N, bp); break;
      case 2: all_rows<2>(xm, K, wp, N, K, ym, N, bp); break;
      case 3: all_rows<3>(xm, K, wp, N, K, ym, N, bp); break;
      case 4: all_rows<4>(xm, K, wp, N, K, ym, N, bp); break;
      case 5: all_rows<5>(xm, K, wp, N, K, ym, N, bp); break;
      case 6: all_rows<6>(xm, K, wp, N, K, ym, N, bp); break;
      case 7: all_rows<7>(xm, K, wp, N, K, ym, N, bp); break;
      default: all_rows<8>(xm, K, wp, N, K, ym, N, bp); break;
    }
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith, lib) {  // a fragment: other sources and Python register draftsmith:: ops too
  lib.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(draftsmith, CPU, lib) { lib.impl("small_linear", &small_linear); }
