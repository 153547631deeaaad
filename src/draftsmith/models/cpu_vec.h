// Vectors of 16 floats in GCC/Clang vector extensions (one zmm with AVX-512, two ymm with AVX2), shared
// by draftsmith's C++ CPU kernels (cpu_attention.cpp, cpu_linear.cpp). Included inside each source's
// anonymous namespace, after <immintrin.h>.

// The ymm-register forms of the kernels' hot loops (AVX2 builds without AVX-512; bitwise the v16f forms,
// which a test checks by building both: DRAFTSMITH_V16F_ONLY keeps the v16f forms in an AVX2 build).
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(DRAFTSMITH_V16F_ONLY)
#define DRAFTSMITH_YMM_FORMS 1
#else
#define DRAFTSMITH_YMM_FORMS 0
#endif
#if defined(DRAFTSMITH_EXPECT_YMM) && !DRAFTSMITH_YMM_FORMS
#error "DRAFTSMITH_EXPECT_YMM: this build does not take the ymm forms (AVX-512 on, or AVX2 off)"
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// r[i] = the sum of the 16 lanes of a[i], i < 16: a fixed transpose-and-add tree (15 combines of two
// shuffles and an add) instead of 16 horizontal sums; the same order of additions on every call.
inline v16f hsum16(const v16f* a) {
  v16f b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = SHUF(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUF(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    d[j] = SHUF(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUF(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUF(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUF(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#if defined(__AVX2__)
// The sum of 16 lanes (lo: 0-7, hi: 8-15) in hsum16's order for one vector: l + (l + 8), then + 4,
// + 2, + 1 (AVX2 paths that reduce one vector at a time, bitwise hsum16's lane of it).
inline float lane_sum(__m256 lo, __m256 hi) {
  const __m256 b = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
inline float lane_sum(const v16f& x) {
  __m256 lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  return lane_sum(lo, hi);
}
#endif
