// Decode-time attention over a static KV cache on the CPU (draftsmith.models.cpu_attention).
//
// Queries q [1, nh, m, hd] at positions pos[j] attend to the slots [lo_j, pos_j] of K, V
// [1, nkv, S, hd] (lo_j = pos_j - W + 1 for a sliding window W, else 0); slots past the
// largest position are never read, so a step costs what the cache holds, not its capacity.
// The query heads of one KV head read its slots together (no repeated K/V). Work is split
// into (KV head, chunk of slots) tasks, each with its own softmax maximum, sum and weighted
// values, combined at the end ("flash-decoding"): a one-query step has enough parallel work.
// Everything accumulates in float32; K/V may be float32 or bfloat16.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kSerialWork = 4096;  // (slots x query rows) below which one thread does it all
// Slots ahead whose V the weighted sum prefetches (one prefetch per 64-byte line): the hardware
// prefetchers alone left the V pass 13-19% slower on the SPR (BENCHMARKS 9p).
constexpr int64_t kPrefetchV = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// e^r for |r| <= ln2/2 (a float or a vector of them): Cephes' expf polynomial, degree 6.
template <typename F>
inline F exp_poly(F r) {
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp for x <= 88 (softmax arguments are <= 0): Cody-Waite reduction by ln 2 and a degree-6
// polynomial on [-ln2/2, ln2/2] (Cephes' expf coefficients), ~1 ulp; plain arithmetic, so the
// loop around it vectorizes (std::exp does not without -ffast-math).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const float y = exp_poly(r);
  union { int32_t i; float f; } two_n;
  two_n.i = (static_cast<int32_t>(fx) + 127) << 23;
  return y * two_n.f;
}

#include "cpu_vec.h"  // v16f (16 floats: one zmm with AVX-512, two ymm with AVX2), v16i, SHUF, load16, hsum16

typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16f load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  const v16u w = __builtin_convertvector(h, v16u) << 16;
  return reinterpret_cast<const v16f&>(w);
}

// exp_approx on a vector's lanes (the same reduction and polynomial; round-to-nearest by the 1.5 * 2^23
// trick instead of floor(x + 1/2), which vector extensions lack). One expression for every width, so a
// lane's result does not depend on it (the compiler fuses the same products into multiply-adds).
template <typename V, typename VI>
inline V exp_lanes(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const V r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const V y = exp_poly(r);
  const VI two_n = (__builtin_convertvector(fx, VI) + 127) << 23;
  return y * reinterpret_cast<const V&>(two_n);
}
inline v16f exp16(v16f x) { return exp_lanes<v16f, v16i>(x); }

inline float hsum(v16f x) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

#if DRAFTSMITH_YMM_FORMS
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8f load8f(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// AVX2 forms of attend_chunk_vec's two passes (16 ymm registers: v16f's arrays there spill to the
// stack; a profile on an AVX2-only EPYC had the weighted sum's multiply-adds reading and writing their
// sums in memory, BENCHMARKS.md 15q). The same products and sums in the same order as GCC compiled that
// form for AVX2 (a score's products and sums rounded apart, the weighted sums fused multiply-adds):
// bitwise its results there (checked on 324 cases of both dtypes, head dims 64 / 128, windows).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// scores[i] = q . K[slot i] for n slots from K (a short block's slots repeated by the caller), each the
// lanes of q[0:16] * k[0:16] + q[16:32] * k[16:32] + ... summed by hsum16's tree (lane_sum).
template <typename T, int HD>
inline void score_slots(const float* qr, const T* const* kt, int n, float* scores) {
  constexpr int C = HD / 16;
  __m256 ql[C], qh[C];
  for (int c = 0; c < C; ++c) {
    ql[c] = _mm256_loadu_ps(qr + 16 * c);
    qh[c] = _mm256_loadu_ps(qr + 16 * c + 8);
  }
  for (int i = 0; i < n; ++i) {
    __m256 xl = _mm256_mul_ps(ql[0], load8(kt[i])), xh = _mm256_mul_ps(qh[0], load8(kt[i] + 8));
    for (int c = 1; c < C; ++c) {  // not fused: as the v16f form's x += q[c] * k compiled for AVX2
      xl = _mm256_add_ps(xl, _mm256_mul_ps(ql[c], load8(kt[i] + 16 * c)));
      xh = _mm256_add_ps(xh, _mm256_mul_ps(qh[c], load8(kt[i] + 16 * c + 8)));
    }
    scores[i] = lane_sum(xl, xh);
  }
}

// acc[k][16c .. 16c + 16) = sum over u of p[k][u] * V[u][16c ..] for G rows k, one 16-value slice c
// of the head dim at a time (2G sums of 8 lanes in registers); the first slice's pass prefetches V.
template <typename T, int HD, int G>
inline void weigh_values(const float* const* p, const T* V, int64_t c0, int64_t n, float* const* acc, bool prefetch) {
  constexpr int C = HD / 16;
  for (int c = 0; c < C; ++c) {
    __m256 ol[G], oh[G];
    for (int k = 0; k < G; ++k) ol[k] = oh[k] = _mm256_setzero_ps();
    for (int64_t u = 0; u < n; ++u) {
      const T* vt = V + (c0 + u) * HD;
      if (prefetch && c == 0 && u + kPrefetchV < n)
        for (int l = 0; l < HD * static_cast<int>(sizeof(T)); l += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vt + kPrefetchV * HD) + l, 0, 3);
      const __m256 vl = load8(vt + 16 * c), vh = load8(vt + 16 * c + 8);
      for (int k = 0; k < G; ++k) {
        const __m256 pk = _mm256_broadcast_ss(p[k] + u);
        ol[k] = _mm256_fmadd_ps(pk, vl, ol[k]);
        oh[k] = _mm256_fmadd_ps(pk, vh, oh[k]);
      }
    }
    for (int k = 0; k < G; ++k) {
      _mm256_storeu_ps(acc[k] + 16 * c, ol[k]);
      _mm256_storeu_ps(acc[k] + 16 * c + 8, oh[k]);
    }
  }
}
#endif

// attend_chunk for a head dim that is a multiple of 16, every query row of the group over the
// chunk's slots together, so each block of K (and of V) is used by all rows while it is in L1:
// the reads from memory overlap the arithmetic instead of preceding it. Scores of 16 slots are
// reduced together (hsum16); a row's slots outside its range score -inf and weigh 0 (their
// K/V are valid positions of this sequence, written before the call: never garbage). The
// weighted values stay in registers, G rows at a time.
template <typename T, int HD>
void attend_chunk_vec(const float* qs, int R, int m, const T* K, const T* V, const int64_t* lo, const int64_t* hi,
                      int64_t c0, int64_t c1, float* smax, float* ssum, float* acc, float* scratch) {
  constexpr int C = HD / 16;
  constexpr int G = std::max(1, 16 / C);  // rows whose sums fit 16 vector registers
  const int64_t n = c1 - c0, ld = (n + 15) / 16 * 16;  // scratch holds R rows of ld scores
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; t += 16) {
    const int64_t w = std::min<int64_t>(16, n - t);
    for (int r = 0; r < R; ++r) {
      const float* qr = qs + static_cast<int64_t>(r) * HD;
#if DRAFTSMITH_YMM_FORMS
      const T* kt[16];
      for (int i = 0; i < 16; ++i) kt[i] = K + (c0 + t + std::min<int64_t>(i, w - 1)) * HD;
      score_slots<T, HD>(qr, kt, 16, scratch + r * ld + t);
#else
      v16f q[C];
      for (int c = 0; c < C; ++c) q[c] = load16(qr + 16 * c);
      v16f part[16];
      for (int i = 0; i < 16; ++i) {
        const T* kt = K + (c0 + t + std::min<int64_t>(i, w - 1)) * HD;  // a short last block repeats its last slot
        v16f x = q[0] * load16(kt);
        for (int c = 1; c < C; ++c) x += q[c] * load16(kt + 16 * c);
        part[i] = x;
      }
      const v16f sc = hsum16(part);
      std::memcpy(scratch + r * ld + t, &sc, sizeof sc);
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    const int j = r % m;
    float* row = scratch + r * ld;
    const int64_t a = std::max(lo[j], c0) - c0, b = std::min(hi[j] + 1, c1) - c0;  // the row's slots, [a, b)
    if (a >= b) {
      for (int64_t u = 0; u < ld; ++u) row[u] = 0.f;
      smax[r] = ninf;
      ssum[r] = 0.f;
      continue;
    }
    for (int64_t u = 0; u < a; ++u) row[u] = ninf;
    for (int64_t u = b; u < ld; ++u) row[u] = ninf;
#if DRAFTSMITH_YMM_FORMS
    // AVX2: the softmax below 8 lanes at a time (its 16-lane form spilled to the stack there and took
    // half the kernel's time, BENCHMARKS.md 15r); lanes 0-7 and 8-15 of every 16 kept apart, so the
    // sum adds the same values in the same order
    v8f mlo = v8f{} + ninf, mhi = mlo;
    for (int64_t u = 0; u < ld; u += 16) {
      const v8f xl = load8f(row + u), xh = load8f(row + u + 8);
      mlo = mlo > xl ? mlo : xl;
      mhi = mhi > xh ? mhi : xh;
    }
    float mx = ninf;  // lanes in another order than the v16f form's: a maximum of exactly 0 may differ in its
                      // sign, which changes neither exp(x - mx) nor the combine's exp(smax - M)
    for (int i = 0; i < 8; ++i) mx = std::max(mx, std::max(mlo[i], mhi[i]));
    v8f slo{}, shi{};
    for (int64_t u = 0; u < ld; u += 16) {
      const v8f xl = load8f(row + u) - mx, xh = load8f(row + u + 8) - mx;
      const v8f el = xl < -87.0f ? v8f{} : exp_lanes<v8f, v8i>(xl);
      const v8f eh = xh < -87.0f ? v8f{} : exp_lanes<v8f, v8i>(xh);
      std::memcpy(row + u, &el, sizeof el);
      std::memcpy(row + u + 8, &eh, sizeof eh);
      slo += el;
      shi += eh;
    }
    float total = 0.f;
    for (int i = 0; i < 8; ++i) total += slo[i];
    for (int i = 0; i < 8; ++i) total += shi[i];
    smax[r] = mx;
    ssum[r] = total;
#else
    v16f vmax = v16f{} + ninf;
    for (int64_t u = 0; u < ld; u += 16) {
      const v16f x = load16(row + u);
      vmax = vmax > x ? vmax : x;
    }
    float mx = ninf;
    for (int i = 0; i < 16; ++i) mx = std::max(mx, vmax[i]);
    v16f vsum{};
    for (int64_t u = 0; u < ld; u += 16) {
      const v16f x = load16(row + u) - mx;
      const v16f e = x < -87.0f ? v16f{} : exp16(x);  // exp(-inf) = 0 exactly
      std::memcpy(row + u, &e, sizeof e);
      vsum += e;
    }
    smax[r] = mx;
    ssum[r] = hsum(vsum);
#endif
  }
#if DRAFTSMITH_YMM_FORMS
  // AVX2 (weigh_values): 4 rows at a time, a 16-value slice of the head dim per pass over V
  for (int r0 = 0; r0 < R; r0 += 4) {
    const int g = std::min(4, R - r0);
    const float* p[4];
    float* a[4];
    for (int k = 0; k < g; ++k) {
      p[k] = scratch + (r0 + k) * ld;
      a[k] = acc + static_cast<int64_t>(r0 + k) * HD;
    }
    switch (g) {
      case 1: weigh_values<T, HD, 1>(p, V, c0, n, a, r0 == 0); break;
      case 2: weigh_values<T, HD, 2>(p, V, c0, n, a, r0 == 0); break;
      case 3: weigh_values<T, HD, 3>(p, V, c0, n, a, r0 == 0); break;
      default: weigh_values<T, HD, 4>(p, V, c0, n, a, r0 == 0); break;
    }
  }
#else
  for (int r0 = 0; r0 < R; r0 += G) {
    const int g = std::min(G, R - r0);
    v16f o[G][C] = {};
    for (int64_t u = 0; u < n; ++u) {
      const T* vt = V + (c0 + u) * HD;
      if (r0 == 0 && u + kPrefetchV < n)  // the first row group reads V from memory: ask ahead for it
        for (int l = 0; l < HD * static_cast<int>(sizeof(T)); l += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vt + kPrefetchV * HD) + l, 0, 3);
      v16f v[C];
      for (int c = 0; c < C; ++c) v[c] = load16(vt + 16 * c);
      for (int k = 0; k < g; ++k) {
        const float p = scratch[(r0 + k) * ld + u];
        for (int c = 0; c < C; ++c) o[k][c] += p * v[c];
      }
    }
    for (int k = 0; k < g; ++k) std::memcpy(acc + static_cast<int64_t>(r0 + k) * HD, o[k], sizeof o[k]);
  }
#endif
}

template <typename T, int HD>
void attend_chunk(const float* qs, int R, int m, const T* K, const T* V, const int64_t* lo, const int64_t* hi,
                  int64_t c0, int64_t c1, int hd_rt, float* smax, float* ssum, float* acc, float* scratch) {
  const int hd = HD > 0 ? HD : hd_rt;
  for (int r = 0; r < R; ++r) {
    const int j = r % m;  // row r = (query head within the group) * m + query j
    const int64_t a = std::max(lo[j], c0), b = std::min(hi[j] + 1, c1);
    float* out = acc + static_cast<int64_t>(r) * hd;
    for (int d = 0; d < hd; ++d) out[d] = 0.f;
    if (a >= b) {
      smax[r] = -std::numeric_limits<float>::infinity();
      ssum[r] = 0.f;
      continue;
    }
    const float* qr = qs + static_cast<int64_t>(r) * hd;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = a; t < b; ++t) {
      const T* kt = K + t * hd;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < hd; ++d) s += qr[d] * to_float(kt[d]);
      scratch[t - a] = s;
      mx = std::max(mx, s);
    }
    const int64_t n = b - a;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float p = exp_approx(scratch[t] - mx);
      scratch[t] = p;
      sum += p;
    }
    if constexpr (HD > 0) {  // the weighted sum in registers (out may alias nothing, but the compiler cannot know)
      float o[HD] = {};
      for (int64_t t = a; t < b; ++t) {
        const T* vt = V + t * HD;
        const float p = scratch[t - a];
#pragma omp simd
        for (int d = 0; d < HD; ++d) o[d] += p * to_float(vt[d]);
      }
      for (int d = 0; d < HD; ++d) out[d] = o[d];
    } else {
      for (int64_t t = a; t < b; ++t) {
        const T* vt = V + t * hd;
        const float p = scratch[t - a];
#pragma omp simd
        for (int d = 0; d < hd; ++d) out[d] += p * to_float(vt[d]);
      }
    }
    smax[r] = mx;
    ssum[r] = sum;
  }
}

template <typename T, int HD>
void run(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const int64_t* lo, const int64_t* hi,
         double scale, int64_t chunk, at::Tensor& out) {
  const int nh = q.size(1), m = q.size(2), hd = q.size(3);
  const int nkv = K.size(1);
  const int64_t S = K.size(2);
  const int rep = nh / nkv, R = rep * m;
  // Chunks split at absolute multiples of `chunk` (the first starts at the lowest slot read, rounded
  // down to 16), so a query's slots fall in the same chunks, and its 16-slot blocks in the same
  // lanes, whatever other queries share the call: its result is bitwise what it gets alone (the
  // rows a verify step attends are one-token steps' rows), windows included.
  const int64_t LO = *std::min_element(lo, lo + m) / 16 * 16, HI = *std::max_element(hi, hi + m) + 1;
  const int64_t CS = LO / chunk * chunk;  // the first chunk's split point (<= LO)
  const int64_t nchunks = std::max<int64_t>(1, (HI - CS + chunk - 1) / chunk);
  // queries as float, pre-scaled: [nkv][R][hd], row r = query head (h*rep + r/m), query j = r%m
  std::vector<float> qs(static_cast<size_t>(nkv) * R * hd);
  const at::Tensor qc = q.to(at::kFloat).contiguous();
  const float* qp = qc.data_ptr<float>();
  for (int h = 0; h < nkv; ++h)
    for (int r = 0; r < R; ++r) {
      const int head = h * rep + r / m, j = r % m;
      const float* src = qp + (static_cast<int64_t>(head) * m + j) * hd;
      float* dst = qs.data() + (static_cast<int64_t>(h) * R + r) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * static_cast<float>(scale);
    }
  const int64_t tasks = nkv * nchunks;
  std::vector<float> smax(tasks * R), ssum(tasks * R), acc(tasks * R * hd);
  const T* Kp = K.data_ptr<T>();
  const T* Vp = V.data_ptr<T>();
  // a short context is cheaper on one thread than the wake-up of the others (~5-10 us)
  const int64_t grain = (HI - LO) * nkv * R < kSerialWork ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(R) * ((chunk + 15) / 16 * 16));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / nchunks, c = task % nchunks;
      const int64_t c0 = std::max(LO, CS + c * chunk), c1 = std::min(HI, CS + (c + 1) * chunk);
      if constexpr (HD > 0 && HD % 16 == 0)
        attend_chunk_vec<T, HD>(qs.data() + h * R * hd, R, m, Kp + h * S * hd, Vp + h * S * hd, lo, hi, c0, c1,
                                smax.data() + task * R, ssum.data() + task * R, acc.data() + task * R * hd,
                                scratch.data());
      else
        attend_chunk<T, HD>(qs.data() + h * R * hd, R, m, Kp + h * S * hd, Vp + h * S * hd, lo, hi, c0, c1, hd,
                            smax.data() + task * R, ssum.data() + task * R, acc.data() + task * R * hd,
                            scratch.data());
    }
  });
  // float32 queries: combine straight into the output; otherwise into float32, converted once at the end
  at::Tensor res = out.scalar_type() == at::kFloat ? out : at::empty({1, nh, m, hd}, q.options().dtype(at::kFloat));
  float* rp = res.data_ptr<float>();
  for (int h = 0; h < nkv; ++h)
    for (int r = 0; r < R; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nchunks; ++c) M = std::max(M, smax[(h * nchunks + c) * R + r]);
      const int head = h * rep + r / m, j = r % m;
      float* dst = rp + (static_cast<int64_t>(head) * m + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = 0.f;
      float total = 0.f;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t t = (h * nchunks + c) * R + r;
        if (ssum[t] == 0.f) continue;
        const float w = std::exp(smax[t] - M);
        total += w * ssum[t];
        const float* a = acc.data() + t * hd;
        for (int d = 0; d < hd; ++d) dst[d] += w * a[d];
      }
      const float inv = 1.f / total;
      for (int d = 0; d < hd; ++d) dst[d] *= inv;
    }
  if (!res.is_same(out)) out.copy_(res);
}

template <typename T>
void dispatch_hd(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const int64_t* lo,
                 const int64_t* hi, double scale, int64_t chunk, at::Tensor& out) {
  switch (q.size(3)) {
    case 64: return run<T, 64>(q, K, V, lo, hi, scale, chunk, out);
    case 128: return run<T, 128>(q, K, V, lo, hi, scale, chunk, out);
    case 256: return run<T, 256>(q, K, V, lo, hi, scale, chunk, out);
    default: return run<T, 0>(q, K, V, lo, hi, scale, chunk, out);
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& pos,
                            int64_t window, double scale, int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && K.dim() == 4 && V.dim() == 4 && q.size(0) == 1 && K.size(0) == 1,
              "decode_attention: q [1, nh, m, hd], K/V [1, nkv, S, hd]");
  TORCH_CHECK(K.is_contiguous() && V.is_contiguous() && K.sizes() == V.sizes(), "decode_attention: contiguous K, V");
  TORCH_CHECK(q.size(3) == K.size(3) && q.size(1) % K.size(1) == 0, "decode_attention: head dims / GQA groups");
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(2) && pos.scalar_type() == at::kLong, "decode_attention: pos [m]");
  TORCH_CHECK(chunk >= 1, "decode_attention: chunk >= 1");
  const int64_t m = q.size(2), S = K.size(2);
  const at::Tensor pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  std::vector<int64_t> lo(m), hi(m);
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(pp[j] >= 0 && pp[j] < S, "decode_attention: position ", pp[j], " outside the cache's ", S, " slots");
    hi[j] = pp[j];
    lo[j] = window > 0 ? std::max<int64_t>(0, pp[j] - window + 1) : 0;
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (K.scalar_type() == at::kFloat) {
    dispatch_hd<float>(q, K, V, lo.data(), hi.data(), scale, chunk, out);
  } else if (K.scalar_type() == at::kBFloat16) {
    dispatch_hd<c10::BFloat16>(q, K, V, lo.data(), hi.data(), scale, chunk, out);
  } else {
    TORCH_CHECK(false, "decode_attention: K/V float32 or bfloat16, got ", K.scalar_type());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(draftsmith, lib) {  // a fragment: Python registers other draftsmith:: ops
  lib.def("decode_attention(Tensor q, Tensor K, Tensor V, Tensor pos, int window, float scale, int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith, CPU, lib) { lib.impl("decode_attention", &decode_attention); }
