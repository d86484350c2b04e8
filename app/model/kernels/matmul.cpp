// Parley's matmul over row-major weights with per-32 block scales: y (M, N) fp32 =
// x (M, K) W^T, W stored as GGUF's Q8_0 (int8 codes and one scale per 32 weights) or as
// plain bf16 / fp32 rows (scale 1). It serves a float LM head, and a Q8_0 one where the
// activations are fp32 (app/model/quant/q8_0.py; with bf16 activations a quantized head runs
// on qmatmul.cpp's group_matmul).
//
// Why our own: a token's logits must be the same bits whether it is decoded alone, scored
// in a prompt of hundreds of rows, or computed on 1 or 2 threads (resumable streams, the
// prefix cache and the kill -9 restart rely on it). oneDNN picks its kernel by the CPU and
// the row count, and on some CPUs (AVX-512 FP16) one row and many come out in other bits.
// Here every output element is computed by the same instructions in the same order,
// whatever M, the tile it falls in, or the thread that computes it:
//
//   for each block b of 32:  t = w[0:16] * x[0:16];  t = fma(w[16:32], x[16:32], t)
//                            acc = fma(scale_b, t, acc)            (16 lanes)
//   y = the 16 lanes of acc added by a fixed tree
//
// Tiles of NR weight rows x MR x rows only share the weight rows' conversion to fp32; the
// arithmetic of an element never sees its neighbours. The AVX-512, AVX2 and portable builds
// (-march=native picks one) do the same operations lane for lane: the same bits on any CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per scale (GGUF's Q8_0 block)

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }

// A vector of kLanes = 16 floats whatever the machine: one AVX-512 register, two AVX2 ones,
// or a plain array. Lane l of an accumulator holds the terms k with k % 16 == l, and the
// lanes are added by one tree (l + l+8, then + 4, + 2, + 1), so every build computes the
// same sums in the same order: an AVX2 machine's logits are an AVX-512 machine's bits.
constexpr int kLanes = 16;

#ifdef __AVX512F__
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}
inline Vec wload(const int8_t* p) {  // 16 weights as fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec wload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec wload(const float* p) { return _mm512_loadu_ps(p); }
#elif defined(__AVX2__)
struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float vsum(Vec v) {
  const __m256 h = _mm256_add_ps(v.lo, v.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}
inline __m256 w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 w8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 w8(const float* p) { return _mm256_loadu_ps(p); }
template <typename W>
inline Vec wload(const W* p) {
  return {w8(p), w8(p + 8)};
}
#else
struct Vec {
  float v[kLanes];
};
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline Vec vzero() { return Vec{}; }
inline Vec vset(float s) {
  Vec r;
  std::fill_n(r.v, kLanes, s);
  return r;
}
inline Vec vmul(Vec a, Vec b) {
  for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l];
  return a;
}
inline Vec vadd(Vec a, Vec b) {
  for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
  return a;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < kLanes; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline float vsum(Vec v) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) v.v[l] += v.v[l + w];
  return v.v[0];
}
template <typename W>
inline Vec wload(const W* p) {
  Vec r;
  for (int l = 0; l < kLanes; ++l) r.v[l] = widen(p[l]);
  return r;
}
#endif

constexpr int kVecs = kBlock / kLanes;  // vectors a block
#ifdef __AVX512F__
constexpr int kNR = 4, kMR = 4;  // weight rows and x rows a tile
#else
constexpr int kNR = 2, kMR = 2;  // AVX2 has half the registers, of half the width
#endif
// How far ahead weights are asked for, in weight rows. A decode (fewer rows of x than kMR)
// is bound by how fast one core streams the weights, and reads them 2 rows a tile: fewer
// rows interleaved, fewer loads in flight per block (a 262,144 x 640 Q8_0 head, 2 threads,
// caches flushed between calls: 9.8 -> 7.9 ms; a plain sum of its bytes takes 6.7 ms).
constexpr int64_t kPrefetchRows = 16;
constexpr int kFewNR = 2;  // weight rows a tile when x has fewer than kMR rows

// y[m, n] for the tile's NR weight rows and MR rows of x (fp32, K apart), K / 32 blocks.
template <typename W, int NR, int MR>
inline void tile(const W* w, const float* scales, const float* x, float* y, int64_t K,
                 int64_t ldy) {
  Vec acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = vzero();
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    // The tile's rows kPrefetchRows on, their bytes spread over its blocks: each weight row
    // is a short stream the hardware prefetcher would see too late.
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * K) +
                        b * NR * kBlock * sizeof(W);
    for (int64_t c = 0; c < NR * kBlock * int64_t(sizeof(W)); c += 64) __builtin_prefetch(ahead + c);
    Vec wv[NR][kVecs];
    Vec d[NR];
    for (int n = 0; n < NR; ++n) {
      for (int v = 0; v < kVecs; ++v) wv[n][v] = wload(w + n * K + b * kBlock + v * kLanes);
      d[n] = vset(scales ? scales[n * blocks + b] : 1.0f);
    }
    for (int m = 0; m < MR; ++m) {
      const float* xb = x + m * K + b * kBlock;
      Vec xv[kVecs];
      for (int v = 0; v < kVecs; ++v) xv[v] = vload(xb + v * kLanes);
      for (int n = 0; n < NR; ++n) {
        Vec t = vmul(wv[n][0], xv[0]);
        for (int v = 1; v < kVecs; ++v) t = vfma(wv[n][v], xv[v], t);
        acc[n][m] = vfma(d[n], t, acc[n][m]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = vsum(acc[n][m]);
}

// Rows [m0, M) of x against weight rows [n0, n0 + nr), nr <= kNR.
template <typename W, int NR>
void rows_of(const W* w, const float* scales, const float* x, float* y, int64_t M, int64_t K,
             int64_t N) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) tile<W, NR, kMR>(w, scales, x + m * K, y + m * N, K, N);
  for (; m < M; ++m) tile<W, NR, 1>(w, scales, x + m * K, y + m * N, K, N);
}

// The weight rows of y = x W^T in tiles of TR, split between threads: body(nr, n0) computes
// weight rows [n0, n0 + nr) (nr a std::integral_constant) for every row of x. Enough tiles
// an item that a thread's share is worth its wake-up, few enough that both threads get work:
// the split never changes an element's bits. `blocks`: K / 32, a row of x's work against a
// weight row.
template <int TR, typename Body>
void weight_tiles(int64_t M, int64_t blocks, int64_t N, const Body& body) {
  const int64_t tiles = (N + TR - 1) / TR;
  const int64_t grain = std::max<int64_t>(1, 4096 * kNR / TR / std::max<int64_t>(1, M * blocks));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TR;
      switch (std::min<int64_t>(TR, N - n0)) {
        case 4: body(std::integral_constant<int, 4>{}, n0); break;
        case 3: body(std::integral_constant<int, 3>{}, n0); break;
        case 2: body(std::integral_constant<int, 2>{}, n0); break;
        default: body(std::integral_constant<int, 1>{}, n0); break;
      }
    }
  });
}

// A decode (fewer rows of x than kMR) reads kFewNR weight rows a tile, anything more kNR.
template <typename Body>
void for_weight_tiles(int64_t M, int64_t blocks, int64_t N, const Body& body) {
  if (M < kMR) weight_tiles<kFewNR>(M, blocks, N, body);
  else weight_tiles<kNR>(M, blocks, N, body);
}

template <typename W>
void block_matmul_impl(const W* w, const float* scales, const float* x, float* y, int64_t M,
                       int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock;
  for_weight_tiles(M, blocks, N, [&](auto nr, int64_t n0) {
    const float* st = scales ? scales + n0 * blocks : nullptr;
    rows_of<W, decltype(nr)::value>(w + n0 * K, st, x, y + n0, M, K, N);
  });
}

// x (M, K) fp32 or bf16; weight (N, K) int8 with scales (N, K / 32) fp32, or bf16 / fp32
// with no scales. Returns y (M, N) fp32.
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "block_matmul: x (M, K) and weight (N, K)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kBlock == 0, "block_matmul: K must be a multiple of ", kBlock);
  TORCH_CHECK(weight.is_contiguous(), "block_matmul: the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_matmul: x must be fp32 or bf16");
  const bool quantized = weight.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == scales.has_value(), "block_matmul: scales go with int8 weights only");
  const float* sp = nullptr;
  at::Tensor sc;
  if (quantized) {
    sc = scales->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 2 && sc.size(0) == N &&
                    sc.size(1) == K / kBlock,
                "block_matmul: scales must be fp32 (N, K / 32)");
    sp = sc.data_ptr<float>();
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
                "block_matmul: weights are int8 (with scales), bf16 or fp32");
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (quantized) {
    block_matmul_impl(weight.data_ptr<int8_t>(), sp, xp, yp, M, K, N);
  } else if (weight.scalar_type() == at::kBFloat16) {
    block_matmul_impl(weight.data_ptr<c10::BFloat16>(), sp, xp, yp, M, K, N);
  } else {
    block_matmul_impl(weight.data_ptr<float>(), sp, xp, yp, M, K, N);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parley, m) {
  m.def("block_matmul(Tensor x, Tensor weight, Tensor? scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(parley, CPU, m) {
  m.impl("block_matmul", &block_matmul);
}
