// Few-row linear (float32, bfloat16 or int8 weights) and RMSNorm on the CPU (draftsmith.models.cpu_linear, `--weight-layout cpp`):
// y [..., N] = x [..., K] W[N, K]^T (+ b).
//
// A decode step has m = 1 row, a verify step m = k + 1, so the product is a read of W with a
// little arithmetic per weight. MKL's and oneDNN's GEMMs are made for many rows: on the AMD EPYC
// of BENCHMARKS.md (15g) the 211 GEMMs of a SmolLM2-135M step took 47 ms through MKL and 29 ms
// through oneDNN at one row, 21 ms here. The kernel streams W from memory once whatever m is:
// output rows in blocks of 8 (eight sequential streams of W per thread, the next block prefetched
// while one is read), each block multiplied with every row of x (x stays in L1) in tiles of 2 rows
// (a block's W is still in L1/L2 for the next tile), 16 accumulators of 16 lanes, summed across
// lanes by one transpose-and-add tree. W stays as the model holds it ([N, K], row-major): no packed copy.
// (Written first for the SPR's compiled verify steps, where it lost to inductor's GEMM template:
// BENCHMARKS.md 9t; the eager steps use it since 15g.)
//
// `rms_norm` (an EAGLE-3 draft's RMSNorm in that layout, and a Llama-style verifier's, float32 or
// bfloat16) is one call instead of ATen's ~6-8 for a row. `argmax_rows` is torch.argmax over rows.
//
// `llama_layer` is a whole pre-norm decoder layer (Llama, Mistral, Qwen2, Qwen3) of an eager step in
// that layout, as one call instead of ~40 (BENCHMARKS.md 15p): the same functions in the same order
// as the lean forward's Python loop over the same ops (this file's GEMMs and norm, the rope's and the
// residuals' elementwise products and sums rounded as ATen rounds them, ATen's silu, the C++
// decode-attention op), so its output is bitwise that loop's.
//
// The same loop reads int8 weights (one float32 scale per output row; `small_linear_i8`, the int8
// draft of `--draft-precision int8`): 16 weights are widened to floats in registers, so a step
// reads a quarter of the bytes and the sums are float32 (W8A32; with a bfloat16 model's activations
// widened once and the result rounded to bfloat16, W8A16).
//
// And bfloat16 weights and activations (a model loaded with `--dtype bfloat16`): W widened to float32 in
// registers (exact: a shift), x widened once per call, the sums in float32, y rounded to bfloat16 to
// nearest even, as ATen rounds; a step reads half the bytes of float32.
//
// Every y[i, n] is the same sum in the same order (lane j holds k = j mod 16, the tree adds
// the lanes in a fixed order, the bias last) whatever m is and whichever tile row i sits in,
// so a verify step's rows are bitwise those of one-token steps over the same inputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

#include "cpu_vec.h"

// Output rows per block (8 sequential streams of W per thread: on the SPR, 4 streams made a verify
// of 2 / 4 rows ~1.14x / 1.29x one row, 8 streams ~1.05x / 1.2x) and x rows per tile: 8 x 2 = the
// 16 accumulators one transpose tree sums.
constexpr int64_t kRowBlock = 8;
constexpr int64_t kTile = 2;
static_assert(kRowBlock * kTile == 16, "one hsum16 per block and tile");

typedef int8_t v16c __attribute__((vector_size(16)));

// The bits of a 64-byte register, or of two 32-byte halves, as 16 floats.
template <typename R>
inline v16f as_v16f(const R& r) {
  static_assert(sizeof(R) == sizeof(v16f), "a 64-byte register");
  v16f v;
  std::memcpy(&v, &r, sizeof v);
  return v;
}
template <typename R>
inline v16f as_v16f(const R& lo, const R& hi) {
  static_assert(2 * sizeof(R) == sizeof(v16f), "two 32-byte halves");
  v16f v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}

// A bfloat16's bits (uint16) as the float32 it is: shifted into the upper half (exact).
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 16 weights as floats: float32 as they are, int8 widened (sign-extended, converted exactly).
inline v16f loadw(const float* p) { return load16(p); }
inline v16f loadw(const int8_t* p) {
#if defined(__AVX512F__)
  return as_v16f(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return as_v16f(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
#else
  v16c c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, v16f);
#endif
}

// 16 bfloat16 weights (their bits, uint16) as floats (bf16_to_float, 8 or 16 at a time).
inline v16f loadw(const uint16_t* p) {
#if defined(__AVX512F__)
  return as_v16f(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  const auto half = [](const uint16_t* q) {
    return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16);
  };
  return as_v16f(half(p), half(p + 8));
#else
  v16f v;
  for (int j = 0; j < 16; ++j) v[j] = bf16_to_float(p[j]);
  return v;
#endif
}

// The first `n` values of p as floats, the rest zero.
template <typename W>
inline v16f load_tail(const W* p, int64_t n) {
  W buf[16] = {};
  std::memcpy(buf, p, n * sizeof(W));
  return loadw(buf);
}

// s * scale[r] (int8 weights) + bias[r]: the product rounded on its own, never fused with the bias's add
// into one multiply-add (which compilers may or may not do), so every build rounds alike.
inline float rescaled(float s, const float* scale, const float* bias, int64_t r) {
  float v = s;
  if (scale) {
    v *= scale[r];
    __asm__ volatile("" : "+x"(v));
  }
  return bias ? v + bias[r] : v;
}

#if DRAFTSMITH_YMM_FORMS
// AVX2 has 16 ymm registers: block_tile's 16 accumulators of 16 lanes are 32 of them, and built for
// AVX2 the compiler kept them in memory (the kernel 2-3x slower than built for AVX-512, BENCHMARKS.md
// 9t; an AVX2-only EPYC 15q). Here a block's rows are taken RB at a time, each output's 16 lanes as two
// halves of 8, RB * T * 2 <= 8 accumulators: the same fused multiply-adds into the same lanes
// (lane j holds k = j mod 16) and the same tree over the lanes as hsum16's, so every y is bitwise
// what the v16f block_tile below gives built for AVX2 (checked on 600 cases of every weight dtype).
inline void loadw2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void loadw2(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
inline void loadw2(const uint16_t* p, __m256& lo, __m256& hi) {
  const auto half = [](const uint16_t* q) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16));
  };
  lo = half(p);
  hi = half(p + 8);
}
template <typename W>
inline void loadw2_tail(const W* p, int64_t n, __m256& lo, __m256& hi) {
  W buf[16] = {};
  std::memcpy(buf, p, n * sizeof(W));
  loadw2(buf, lo, hi);
}

// Rows r0 .. r0 + RB - 1 of a block (wr: its kRowBlock row pointers), stored where r < R.
template <int T, int RB, typename W>
inline void sub_block(const float* const* xr, int stored, const W* const* wr, int64_t r0, int64_t K, int64_t R,
                      int64_t ahead, const float* scale, const float* bias, float* y, int64_t ldy) {
  __m256 lo[T][RB], hi[T][RB];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < RB; ++r) lo[t][r] = hi[t][r] = _mm256_setzero_ps();
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 xl[T], xh[T];
    for (int t = 0; t < T; ++t) {
      xl[t] = _mm256_loadu_ps(xr[t] + k);
      xh[t] = _mm256_loadu_ps(xr[t] + k + 8);
    }
    for (int r = 0; r < RB; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(wr[r0 + r] + k) + ahead, 0, 2);
      __m256 wl, wh;
      loadw2(wr[r0 + r] + k, wl, wh);
      for (int t = 0; t < T; ++t) {
        lo[t][r] = _mm256_fmadd_ps(xl[t], wl, lo[t][r]);
        hi[t][r] = _mm256_fmadd_ps(xh[t], wh, hi[t][r]);
      }
    }
  }
  if (K16 < K) {
    for (int t = 0; t < T; ++t) {
      __m256 xl, xh;
      loadw2_tail(xr[t] + K16, K - K16, xl, xh);
      for (int r = 0; r < RB; ++r) {
        __m256 wl, wh;
        loadw2_tail(wr[r0 + r] + K16, K - K16, wl, wh);
        lo[t][r] = _mm256_fmadd_ps(xl, wl, lo[t][r]);
        hi[t][r] = _mm256_fmadd_ps(xh, wh, hi[t][r]);
      }
    }
  }
  for (int t = 0; t < stored; ++t)
    for (int r = 0; r < RB && r0 + r < R; ++r) {
      y[t * ldy + r0 + r] = rescaled(lane_sum(lo[t][r], hi[t][r]), scale, bias, r0 + r);
    }
}

// y[t, n0 + r] for r < R (R <= kRowBlock) and the x rows xr[t], t < T (AVX2; see sub_block).
template <int T, typename W>
inline void block_tile(const float* const* xr, int stored, const W* w, int64_t K, int64_t R, const float* scale,
                       const float* bias, float* y, int64_t ldy) {
  constexpr int RB = 4 / T;
  const int64_t ahead = kRowBlock * K * static_cast<int64_t>(sizeof(W));
  const W* wr[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) wr[r] = w + std::min(r, R - 1) * K;
  for (int64_t r0 = 0; r0 < R; r0 += RB) sub_block<T, RB>(xr, stored, wr, r0, K, R, ahead, scale, bias, y, ldy);
}
#else
// y[t, n0 + r] for r < R (R <= kRowBlock) and the x rows xr[t], t < T; rows of W past R are
// computed on a repeat of the last valid one and never stored, and so are tile rows past `stored`.
// A sum is multiplied by its row's `scale` (int8 weights) before the bias is added.
template <int T, typename W>
inline void block_tile(const float* const* xr, int stored, const W* w, int64_t K, int64_t R, const float* scale,
                       const float* bias, float* y, int64_t ldy) {
  // each stream prefetches the same offset of the next block of rows (the block this thread most
  // likely multiplies next): the whole next block arrives while this one is read (BENCHMARKS.md 15o,
  // EPYC: a step's bfloat16 GEMMs 0.79x and an int8 draft step's cold 0.57x those with 512 bytes
  // ahead in the same row, which for rows of 576-1152 bytes landed mostly in the block being read)
  const int64_t ahead = kRowBlock * K * static_cast<int64_t>(sizeof(W));
  const W* wr[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) wr[r] = w + std::min(r, R - 1) * K;
  v16f acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = v16f{};
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    v16f wv[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(wr[r] + k) + ahead, 0, 2);
      wv[r] = loadw(wr[r] + k);
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
    for (int64_t r = 0; r < R; ++r) {
      y[t * ldy + r] = rescaled(s[t * kRowBlock + r], scale, bias, r);
    }
}

#endif

template <typename W>
void rows_block(const float* x, int64_t m, int64_t ldx, const W* w, int64_t K, int64_t R, const float* scale,
                const float* bias, float* y, int64_t ldy) {
  for (int64_t i = 0; i < m; i += kTile) {
    const int left = static_cast<int>(std::min<int64_t>(kTile, m - i));
    const float* xr[kTile];
    for (int t = 0; t < kTile; ++t) xr[t] = x + (i + std::min(t, left - 1)) * ldx;
    float* yi = y + i * ldy;
    if (left == 1) block_tile<1>(xr, 1, w, K, R, scale, bias, yi, ldy);
    else block_tile<kTile>(xr, left, w, K, R, scale, bias, yi, ldy);
  }
}

// y [m, N] = x [m, K] w[N, K]^T (* scale[N]) (+ b[N]), output rows split across threads in blocks.
template <typename W>
void linear_rows(const float* xp, int64_t m, int64_t K, const W* wp, int64_t N, const float* sp, const float* bp,
                 float* yp) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // ~64 KB of float32 W per task at least (as many rows of int8): a small projection stays on one thread
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / kRowBlock);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRowBlock;
      const int64_t R = std::min(kRowBlock, N - n0);
      rows_block(xp, m, K, wp + n0 * K, K, R, sp ? sp + n0 : nullptr, bp ? bp + n0 : nullptr, yp + n0, N);
    }
  });
}

// x [..., K] as a contiguous [m, K] of `dtype` (float32, or bfloat16), after the checks every entry
// point shares.
at::Tensor rows_of(const char* op, const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == dtype, op, ": ", dtype == at::kFloat ? "float32" : "bfloat16", " x expected, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              op, ": x [..., K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  return x.reshape({-1, w.size(1)}).contiguous();
}

// A float32 [N] vector (a bias or a scale), contiguous, or undefined when absent; a bfloat16 one (the
// bias of a bfloat16 model's layer, where `bf16_ok`) is widened to float32.
at::Tensor per_row(const char* op, const char* what, const c10::optional<at::Tensor>& v, int64_t N,
                   bool bf16_ok = false) {
  if (!v.has_value() || !v->defined()) return at::Tensor();
  const auto t = v->scalar_type();
  TORCH_CHECK(v->dim() == 1 && v->size(0) == N && v->device().is_cpu() &&
              (t == at::kFloat || (bf16_ok && t == at::kBFloat16)),
              op, ": ", what, bf16_ok ? " [N] float32 or bfloat16 expected" : " [N] float32 expected");
  return v->to(at::kFloat).contiguous();
}

// A contiguous [m, n] bfloat16 tensor as float32 (exact: each value's bits shifted into a float's
// upper half). This and `rounded` are what ATen's `.to()` computes, written out because `.to()`'s
// dispatch costs ~1 us more per call (measured: the int8 form 12-17 -> 14-18 us, the norm 3.6 -> 4.3 us), and
// a bfloat16 draft step converts 20 times.
at::Tensor widened(const at::Tensor& xb) {
  at::Tensor xf = at::empty(xb.sizes(), xb.options().dtype(at::kFloat));
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  float* xd = xf.data_ptr<float>();
  for (int64_t i = 0; i < xb.numel(); ++i) xd[i] = bf16_to_float(xs[i]);
  return xf;
}

// A float32 tensor rounded to bfloat16 to nearest even, as ATen rounds.
at::Tensor rounded(const at::Tensor& y) {
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty(yc.sizes(), yc.options().dtype(at::kBFloat16));
  const float* yp = yc.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < yc.numel(); ++i) op[i] = at::BFloat16(yp[i]);
  return out;
}

// W's elements as the kernel reads them (bfloat16 as its bits).
template <typename W>
const W* weights(const at::Tensor& wc) { return wc.data_ptr<W>(); }
template <>
const uint16_t* weights<uint16_t>(const at::Tensor& wc) {
  return reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
}

// y [..., N] (float32) of x's shape, for the float32 rows xc [m, K].
template <typename W>
at::Tensor run(const at::Tensor& x, const at::Tensor& xc, const at::Tensor& w, const at::Tensor& sc,
               const at::Tensor& bc) {
  const at::Tensor wc = w.contiguous();
  const int64_t m = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty({m, N}, xc.options());
  if (m == 0 || N == 0) return y.view(shape);
  linear_rows<W>(xc.data_ptr<float>(), m, K, weights<W>(wc), N, sc.defined() ? sc.data_ptr<float>() : nullptr,
                 bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y.view(shape);
}

// 1 / sqrt(mean(x^2) + eps) of one row of H floats; the squares summed in 16 lanes (element k in lane
// k mod 16), then the lanes in order, so a row's result does not depend on the other rows.
float inv_rms(const float* x, int64_t H, float eps) {
  v16f acc{};
  const int64_t H16 = H - H % 16;
  for (int64_t k = 0; k < H16; k += 16) {
    const v16f v = load16(x + k);
    acc += v * v;
  }
  if (H16 < H) {
    const v16f v = load_tail(x + H16, H - H16);
    acc += v * v;
  }
  float ss = 0.f;
  for (int j = 0; j < 16; ++j) ss += acc[j];
  return 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
}

}  // namespace

// float32 x and w: y = w * (x * r). bfloat16 x and w (a bfloat16 draft's or Llama-style verifier's norm,
// computed in float32 as eagle3.RMSNorm and LlamaRMSNorm do): y = bf16(w * bf16(x * r)), their two roundings.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf) && w.scalar_type() == x.scalar_type(),
              "rms_norm: float32 x and w, or bfloat16 x and w");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: x [..., H] and w [H] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t H = w.size(0);
  const at::Tensor xc = x.reshape({-1, H}).contiguous();
  const at::Tensor wc = w.contiguous();
  if (!bf) {
    at::Tensor y = at::empty_like(xc);
    const float* xp = xc.data_ptr<float>();
    const float* wp = wc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < xc.size(0); ++r) {
      const float s = inv_rms(xp + r * H, H, static_cast<float>(eps));
      for (int64_t k = 0; k < H; ++k) yp[r * H + k] = wp[k] * (xp[r * H + k] * s);
    }
    return y.view(x.sizes());
  }
  const at::Tensor xf = widened(xc);  // the sum of squares reads floats
  at::Tensor y = at::empty_like(xc);
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < xc.size(0); ++r) {
    const float s = inv_rms(xp + r * H, H, static_cast<float>(eps));
    for (int64_t k = 0; k < H; ++k)
      yp[r * H + k] = at::BFloat16(bf16_to_float(wp[k]) * static_cast<float>(at::BFloat16(xp[r * H + k] * s)));
  }
  return y.view(x.sizes());
}

// float32 x and w; or bfloat16 x and w (x widened once, W in registers, the sums in float32, y rounded
// to bfloat16). The bias may be float32 or, with bfloat16 w, bfloat16.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  const bool bf = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf || w.scalar_type() == at::kFloat, "small_linear: float32 or bfloat16 w");
  const at::Tensor xc = rows_of("small_linear", x, w, bf ? at::kBFloat16 : at::kFloat);
  const at::Tensor bc = per_row("small_linear", "b", b, w.size(0), bf);
  if (bf) return rounded(run<uint16_t>(x, widened(xc), w, at::Tensor(), bc));
  return run<float>(x, xc, w, at::Tensor(), bc);
}

// int8 w with float32 scales; float32 x (W8A32), or bfloat16 x (W8A16: x widened once, y rounded to
// bfloat16). The bias may be float32 or bfloat16 either way (a bfloat16 draft's layer fed float32 rows).
at::Tensor small_linear_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& b) {
  const bool bf = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = rows_of("small_linear_i8", x, w, bf ? at::kBFloat16 : at::kFloat);
  TORCH_CHECK(w.scalar_type() == at::kChar, "small_linear_i8: int8 w");
  const at::Tensor sc = per_row("small_linear_i8", "scale", scale, w.size(0));
  TORCH_CHECK(sc.defined(), "small_linear_i8: a scale is needed");
  const at::Tensor bc = per_row("small_linear_i8", "b", b, w.size(0), /*bf16_ok=*/true);
  if (bf) return rounded(run<int8_t>(x, widened(xc), w, sc, bc));
  return run<int8_t>(x, xc, w, sc, bc);
}

namespace {

// v as an opaque value: a float product is rounded on its own, not contracted with the next sum
// into one fused multiply-add (ATen's elementwise ops round each op); bfloat16 rounds each op anyway.
template <typename T>
inline T rounded_alone(T v) {
  if (std::is_same<T, float>::value) __asm__ volatile("" : "+m"(v));
  return v;
}

// y = a + b elementwise, rounded to T (ATen's add), for the residuals.
template <typename T>
at::Tensor sum_of(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor y = at::empty_like(a);
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for (int64_t i = 0; i < a.numel(); ++i) yp[i] = ap[i] + bp[i];
  return y;
}

// The layer for T (float or c10::BFloat16); see llama_layer below.
using Optionals = std::vector<c10::optional<at::Tensor>>;

template <typename T>
at::Tensor layer(const at::Tensor& x, const c10::optional<at::Tensor>& resid, const std::vector<at::Tensor>& w,
                 const Optionals& s, const Optionals& b, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& K,
                 at::Tensor& V, const at::Tensor& pos, int64_t start, int64_t window, double scale, double eps,
                 double qk_eps, int64_t nh, int64_t nkv, int64_t hd, int64_t chunk) {
  static const auto attention = c10::Dispatcher::singleton()
      .findSchemaOrThrow("draftsmith::decode_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                        int64_t)>();
  const int64_t S = K.size(2), half = hd / 2;
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t m = x2.size(0);
  const bool given = resid.has_value() && resid->defined();  // x is the attention's input (a draft's)
  const at::Tensor r2 = given ? resid->reshape({m, -1}).contiguous() : x2;
  // projection j (q, k, v, o, gate, up, down): w[1..4, 6..8]; int8 weights where s[j] (a scale) is given
  const auto proj = [&](const at::Tensor& in, int j) {
    const at::Tensor& W = w[j < 4 ? j + 1 : j + 2];
    return s[j].has_value() && s[j]->defined() ? small_linear_i8(in, W, *s[j], b[j]) : small_linear(in, W, b[j]);
  };
  // attention input: the norm, q / k / v, Qwen3's per-head norms
  const at::Tensor h = given ? x2 : rms_norm(x2, w[0], eps);
  at::Tensor q = proj(h, 0);
  at::Tensor k = proj(h, 1);
  const at::Tensor v = proj(h, 2);
  if (w.size() == 11) {
    q = rms_norm(q.view({m * nh, hd}), w[9], qk_eps).view({m, nh * hd});
    k = rms_norm(k.view({m * nkv, hd}), w[10], qk_eps).view({m, nkv * hd});
  }
  // rope, rotate-half folded (lean.rope_folded): x * cos + roll(x, hd / 2) * sin_folded, each product and
  // the sum rounded to T; q into [1, nh, m, hd], k and v into the cache's slots start .. start + m - 1
  const at::Tensor c = cos.reshape({m, hd}).contiguous(), sf = sin.reshape({m, hd}).contiguous();
  const T* cp = c.data_ptr<T>();
  const T* sp = sf.data_ptr<T>();
  const auto rope = [&](const T* in, T* out, int64_t j) {
    for (int64_t d = 0; d < hd; ++d) {
      const T a = rounded_alone<T>(in[d] * cp[j * hd + d]);
      const T r = rounded_alone<T>(in[d < half ? d + half : d - half] * sp[j * hd + d]);
      out[d] = a + r;
    }
  };
  at::Tensor qr = at::empty({1, nh, m, hd}, x2.options());
  const T* qp = q.data_ptr<T>();
  T* qrp = qr.data_ptr<T>();
  for (int64_t j = 0; j < m; ++j)
    for (int64_t head = 0; head < nh; ++head) rope(qp + (j * nh + head) * hd, qrp + (head * m + j) * hd, j);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* Kp = K.data_ptr<T>();
  T* Vp = V.data_ptr<T>();
  for (int64_t j = 0; j < m; ++j)
    for (int64_t head = 0; head < nkv; ++head) {
      const int64_t slot = (head * S + start + j) * hd;
      rope(kp + (j * nkv + head) * hd, Kp + slot, j);
      std::memcpy(Vp + slot, vp + (j * nkv + head) * hd, hd * sizeof(T));
    }
  const at::Tensor a = attention.call(qr, K, V, pos, window, scale, chunk);  // [1, nh, m, hd]
  const at::Tensor o = proj(a.view({nh, m, hd}).transpose(0, 1).reshape({m, nh * hd}), 3);
  const at::Tensor x1 = sum_of<T>(r2, o);
  // MLP: the norm, silu(gate) * up (ATen's silu), down, the residual
  const at::Tensor h2 = rms_norm(x1, w[5], eps);
  const at::Tensor g = at::silu(proj(h2, 4));
  at::Tensor p = proj(h2, 5);
  {
    const T* gp = g.data_ptr<T>();
    T* pp = p.data_ptr<T>();
    for (int64_t i = 0; i < p.numel(); ++i) pp[i] = gp[i] * pp[i];
  }
  return sum_of<T>(x1, proj(p, 6)).view(given ? resid->sizes() : x.sizes());
}

}  // namespace

namespace {

// The index of the first largest value of p[0 .. n) as torch.argmax gives it: a NaN counts as the
// largest (its first index), and a row of -inf gives 0. One pass keeps 16 lanes' maxima and whether a
// NaN was seen; a second finds the first index of the maximum (or of a NaN).
template <typename W>
int64_t first_argmax(const W* p, int64_t n) {
  const int64_t n16 = n - n % 16;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (n16) {
    v16f mx = loadw(p);
    v16i seen = mx != mx;
    for (int64_t k = 16; k < n16; k += 16) {
      const v16f v = loadw(p + k);
      seen |= v != v;
      mx = v > mx ? v : mx;
    }
    for (int j = 0; j < 16; ++j) {
      nan |= seen[j] != 0;
      best = std::max(best, mx[j]);
    }
  }
  const auto at = [&](int64_t k) -> float {
    if constexpr (std::is_same<W, float>::value) return p[k];
    else return bf16_to_float(p[k]);
  };
  for (int64_t k = n16; k < n; ++k) {
    const float v = at(k);
    nan |= v != v;
    best = std::max(best, v);
  }
  for (int64_t k = 0; k < n; ++k) {
    const float v = at(k);
    if (nan ? v != v : v == best) return k;
  }
  return 0;
}

}  // namespace

// The argmax of each row of x [..., n] (float32 or bfloat16, CPU) as torch.argmax(x, -1) gives it
// (first index of the largest; a NaN is the largest), without ATen's reduction: a bfloat16 row of a
// SmolLM2 verifier's 49152 logits took ATen 178 us on the EPYC (float32 43 us; BENCHMARKS.md 15p).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax_rows: a float32 or bfloat16 CPU tensor [..., n], n > 0");
  const int64_t n = x.size(-1);
  const at::Tensor xc = x.reshape({-1, n}).contiguous();
  auto shape = x.sizes().vec();
  shape.pop_back();
  at::Tensor out = at::empty({xc.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < xc.size(0); ++r)
    op[r] = x.scalar_type() == at::kFloat ? first_argmax(xc.data_ptr<float>() + r * n, n)
                                          : first_argmax(weights<uint16_t>(xc) + r * n, n);
  return out.view(shape);
}

// One pre-norm decoder layer of an eager step over m <= 16 rows x [..., H] (float32 or bfloat16):
//   h = x + o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))));  out = h + down(silu(gate(n2(h))) * up(n2(h)))
// or, with `resid` (an EAGLE-3 draft's layer: x is its attention input, [embedding norm, hidden norm], and
// resid what the attention's output is added to), h = resid + o(attention(... q(x) ...)), the rest the same.
// w: n1's weight (unused with resid), Wq, Wk, Wv, Wo, n2's weight, Wgate, Wup, Wdown[, q_norm's, k_norm's
// weight (Qwen3)]; s: the 7 projections' int8 scales where their weight is int8 (an int8 draft's, the
// kernel's int8 form), else None; b: their biases (None where absent). cos / sin_folded [.., m, hd]: the
// rope tables in the lean forward's rope_folded form. The new keys (roped) and values are written into
// K, V [1, nkv, S, hd] at slots start .. start + m - 1; the queries attend through draftsmith::decode_attention
// to the slots up to pos [m] (window 0: all before; the lean caches pass pos = start .. start + m - 1, as
// their Python loop does). Returns the layer's output, of x's (or resid's) shape.
at::Tensor llama_layer(const at::Tensor& x, const c10::optional<at::Tensor>& resid, at::TensorList w,
                       const c10::List<c10::optional<at::Tensor>>& s, const c10::List<c10::optional<at::Tensor>>& b,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor K, at::Tensor V, const at::Tensor& pos,
                       int64_t start, int64_t window, double scale, double eps, double qk_eps, int64_t nh, int64_t nkv,
                       int64_t hd, int64_t chunk) {
  TORCH_CHECK(w.size() == 9 || w.size() == 11, "llama_layer: 9 weights, or 11 with q/k norms; got ", w.size());
  TORCH_CHECK(s.size() == 7 && b.size() == 7, "llama_layer: 7 scales and 7 biases (None where absent)");
  TORCH_CHECK(nh > 0 && nkv > 0 && hd > 0 && x.dim() >= 1 && x.size(-1) > 0, "llama_layer: nh, nkv, hd and x's width > 0");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "llama_layer: float32 or bfloat16 x");
  Optionals ss, bs;
  for (size_t i = 0; i < 7; ++i) {
    ss.push_back(s.get(i));
    bs.push_back(b.get(i));
  }
  const bool given = resid.has_value() && resid->defined();
  for (size_t i = 0; i < w.size(); ++i) {
    if (i == 0 && given) continue;
    const int j = i >= 1 && i <= 4 ? static_cast<int>(i) - 1 : i >= 6 && i <= 8 ? static_cast<int>(i) - 2 : -1;
    const bool int8 = j >= 0 && ss[j].has_value() && ss[j]->defined();
    TORCH_CHECK(w[i].scalar_type() == (int8 ? at::kChar : dt) && w[i].device().is_cpu(),
                "llama_layer: weights of x's dtype (int8 where a scale is given) on the CPU; weight ", i, " is ",
                w[i].scalar_type());
  }
  // the shapes every loop below relies on: [out, in] projections chained as the layer chains them
  const int64_t H = given ? resid->size(-1) : x.size(-1), I = w[6].size(0);
  const auto is = [&](size_t i, int64_t rows, int64_t cols) { return w[i].dim() == 2 && w[i].size(0) == rows && w[i].size(1) == cols; };
  TORCH_CHECK(is(1, nh * hd, x.size(-1)) && is(2, nkv * hd, x.size(-1)) && is(3, nkv * hd, x.size(-1)) &&
              is(4, H, nh * hd) && is(6, I, H) && is(7, I, H) && is(8, H, I) && (given || w[0].numel() == H) &&
              w[5].numel() == H && (w.size() == 9 || (w[9].numel() == hd && w[10].numel() == hd)),
              "llama_layer: weights of shapes Wq [nh*hd, K], Wk / Wv [nkv*hd, K], Wo [H, nh*hd], Wgate / Wup [I, H], "
              "Wdown [H, I], norms [H] (q/k norms [hd])");
  TORCH_CHECK(!given || (resid->scalar_type() == dt && resid->numel() / resid->size(-1) == x.numel() / x.size(-1)),
              "llama_layer: resid of x's dtype and rows");
  TORCH_CHECK(K.scalar_type() == dt && V.scalar_type() == dt && K.is_contiguous() && V.is_contiguous() && K.dim() == 4 &&
              K.sizes() == V.sizes() && K.size(0) == 1 && K.size(1) == nkv && K.size(3) == hd,
              "llama_layer: contiguous K, V [1, nkv, S, hd] of x's dtype");
  TORCH_CHECK(hd % 2 == 0 && nh % nkv == 0 && cos.numel() == sin.numel() && cos.scalar_type() == dt &&
              sin.scalar_type() == dt, "llama_layer: even head dim, GQA groups, rope tables of x's dtype");
  const int64_t m = x.numel() / x.size(-1);
  TORCH_CHECK(cos.numel() == m * hd && pos.numel() == m && start >= 0 && start + m <= K.size(2),
              "llama_layer: rope tables [m, hd], pos [m] and slots inside the cache");
  for (size_t j = 0; j < 7; ++j)
    TORCH_CHECK(!bs[j].has_value() || !bs[j]->defined() || bs[j]->numel() == w[j < 4 ? j + 1 : j + 2].size(0),
                "llama_layer: bias ", j, " of its projection's output size");
  const std::vector<at::Tensor> ws(w.begin(), w.end());
  if (dt == at::kFloat)
    return layer<float>(x, resid, ws, ss, bs, cos, sin, K, V, pos, start, window, scale, eps, qk_eps, nh, nkv, hd, chunk);
  return layer<c10::BFloat16>(x, resid, ws, ss, bs, cos, sin, K, V, pos, start, window, scale, eps, qk_eps, nh, nkv,
                              hd, chunk);
}

TORCH_LIBRARY_FRAGMENT(draftsmith, lib) {  // a fragment: other sources and Python register draftsmith:: ops too
  lib.def("small_linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  lib.def("llama_layer(Tensor x, Tensor? resid, Tensor[] w, Tensor?[] s, Tensor?[] b, Tensor cos, Tensor sin, "
          "Tensor(a!) K, Tensor(b!) V, Tensor pos, int start, int window, float scale, float eps, float qk_eps, "
          "int nh, int nkv, int hd, int chunk) -> Tensor");
  lib.def("small_linear_i8(Tensor x, Tensor w, Tensor scale, Tensor? b) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith, CPU, lib) {
  lib.impl("small_linear", &small_linear);
  lib.impl("small_linear_i8", &small_linear_i8);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("llama_layer", &llama_layer);
  lib.impl("argmax_rows", &argmax_rows);
}
