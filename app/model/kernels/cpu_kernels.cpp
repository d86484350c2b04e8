// Parley's fused CPU kernels for the layer's small ops (app/model/kernels/__init__.py builds
// and loads this file). Each replaces a run of PyTorch ops whose cost at a decode step is
// their count, not their arithmetic: at one request a layer's norm, rotary, K/V write and
// attention were ~25 tensor ops of 1-13 us each for a few thousand multiply-adds.
//
// Rounding follows the ops they replace: every value a PyTorch op would store in the
// model's dtype (bf16) is rounded to it here too, so a fused result equals the op-by-op one
// except where a float sum is taken in another order (the norm's sum of squares, the
// attention's dot products). Every kernel computes a row, a head or a block of keys on its
// own, never depending on what else is in the batch: a sequence gets the same bits alone or
// batched.
//
// Parallel loops use ATen's (OpenMP) pool; the extension links the libgomp that torch has
// already loaded, so there is one pool of threads, not two.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace parley_kernels {  // qmatmul.cpp
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m, c10::optional<at::ScalarType> out_dtype);
bool amx_enabled();
at::Tensor group_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t group, int64_t bits,
                        int64_t base, c10::optional<at::ScalarType> out_dtype);
}

namespace {

constexpr int kLanes = 16;  // partial sums kept apart, so that sums vectorize without -ffast-math

// term(0) + ... + term(n - 1), kept in kLanes partial sums (term i in lane i % kLanes) that
// are then added as a tree (8 + 8, 4 + 4, ...): vector adds throughout, where a running sum
// would be a chain of dependent scalar adds. The order is fixed by n alone.
template <typename F>
inline float lane_sum(int64_t n, F term) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += term(i + l);
  for (int l = 0; i < n; ++i, ++l) lanes[l] += term(i);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// lane_sum(D, q[d] * k[d]) for D a multiple of kLanes, the same sums in the same order, in
// AVX-512 registers: lane l's partial sum is one vector lane, and the tree is three halvings
// and a last add. (gcc does not see that the scalar lane_sum's tree is this.)
#ifdef __AVX512F__
template <int64_t kD>
inline float dot_lanes(const float* q, const float* k) {
  static_assert(kD % kLanes == 0 && kLanes == 16, "one vector a chunk");
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < kD; i += kLanes)
    lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i)));
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(lanes), high);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// A float as the model's dtype stores it: rounded to nearest even for bf16, as is for fp32.
template <typename T>
inline float stored(float x) {
  return widen(static_cast<T>(x));
}

// dst[d] = widen(src[d]) for d < n: bf16 is fp32's upper half, so 16 at a time with AVX-512.
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = widen(src[d]);
}
inline void widen_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
#ifdef __AVX512F__
  for (; d + 16 <= n; d += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; d < n; ++d) dst[d] = widen(src[d]);
}

// Attention's q and k rows as its dot products read them. A bf16 row whose size is a
// multiple of 32 is widened with each 32 dims' odd ones first, then the even ones: lane l of
// the 16-lane sums (lane_sum, dot_lanes, reduce16) then adds, for every 32 dims,
// q[2l + 1] k[2l + 1] and then q[2l] k[2l], which is vdpbf16ps's order, and a product of
// two bf16 values is exact, so there a multiply then an add is its fused add. So the fp32
// loops here and vdpbf16ps on the rows as stored (prefill_span, with AVX-512 BF16) give
// the same bits. Other rows are widened in order.
template <typename T>
constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;

template <typename T>
inline bool pairs_layout(int64_t D) {
  return kPairs<T> && D % 32 == 0;
}

template <typename T>
inline void widen_qk(const T* src, float* dst, int64_t D) {
  if (!pairs_layout<T>(D)) {
    widen_row(src, dst, D);
    return;
  }
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t c = 0;
#ifdef __AVX512F__
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (; c < D; c += 32) {  // dword l holds dims 2l (low half) and 2l + 1 (high half)
    const __m512i pairs = _mm512_loadu_si512(s + c);
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_and_si512(pairs, high)));
    _mm512_storeu_ps(dst + c + 16, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
  }
#endif
  for (; c < D; c += 32)
    for (int64_t l = 0; l < 16; ++l) {
      uint32_t odd = static_cast<uint32_t>(s[c + 2 * l + 1]) << 16;
      uint32_t even = static_cast<uint32_t>(s[c + 2 * l]) << 16;
      std::memcpy(dst + c + l, &odd, 4);
      std::memcpy(dst + c + 16 + l, &even, 4);
    }
}

// exp(x) for x <= 0 (softmax arguments), written so that loops over it vectorize:
// 2^n * p(r) with r in [-ln2/2, ln2/2] and Cephes' degree-7 polynomial for expf; within
// ~2 ulp of expf. Arguments below -87 are taken as -87 (exp ~1e-38, never a denormal).
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;  // ln 2 = hi - lo
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_neg(float x) {
  x = x < kExpFloor ? kExpFloor : x;
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = (x - n * kLn2Hi) + n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The largest of s[0 .. n), -inf for none. A maximum is exact in any order (the sign of a
// zero aside, which the softmax's s - m does not see), so AVX-512 takes 16 at a time
// where gcc would keep the scalar loop's chain of compares.
inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef __AVX512F__
  if (n >= 16) {
    __m512 vm = _mm512_set1_ps(m);
    for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(vm);
  }
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

#ifdef __AVX512F__
inline __m512 exp_neg16(__m512 x) {  // exp_neg of 16 values, its operations in its order
  const auto f = [](float c) { return _mm512_set1_ps(c); };
  x = _mm512_max_ps(f(kExpFloor), x);  // x < floor ? floor : x, a NaN kept as the scalar keeps it
  const __m512 k = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, f(kLog2e)), f(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, f(kLn2Hi))),
                                 _mm512_mul_ps(k, f(kLn2Lo)));
  __m512 p = f(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, r), f(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), f(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// s[j] = exp_neg(s[j] - m) for j < n. AVX-512 takes 16 at a time with exp_neg's own
// operations in its order, so each value is the scalar one's bits (gcc leaves the scalar
// loop unvectorized).
inline void exp_shifted(float* s, int64_t n, float m) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(s + j, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm)));
#endif
  for (; j < n; ++j) s[j] = exp_neg(s[j] - m);
}

// ---------------------------------------------------------------------------------------
// RMSNorm, as F.rms_norm computes it (torch 2.13): in fp32, x * rsqrt(mean(x^2) + eps) *
// weight, rounded to the dtype once.

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float sum = lane_sum(n, [&](int64_t i) { return widen(x[i]) * widen(x[i]); });
  const float r = std::pow(sum / static_cast<float>(n) + eps, -0.5f);  // as torch.rsqrt
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<T>(widen(x[j]) * r * widen(w[j]));
}

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * n, w, out + r * n, n, eps);
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected a contiguous (rows, hidden) tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "the norm's weight must be (hidden,) in the activations' dtype");
  TORCH_CHECK(w.is_contiguous(), "the norm's weight must be contiguous");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_rows(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
             x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// (rms_norm(x + residual), x + residual): the residual stream's add fused into the norm
// that reads it, as vLLM's fused_add_rms_norm. The sum is rounded to the dtype, as the add
// alone would store it, before it is normed.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "the residual must match x");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const int64_t rows = x.size(0), n = x.size(1);
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < n; ++j)
          s[r * n + j] = static_cast<scalar_t>(widen(a[r * n + j]) + widen(b[r * n + j]));
        rms_row(s + r * n, wp, o + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// ---------------------------------------------------------------------------------------
// Rotary embedding of q and k, and the step's K/V written into the paged cache.
//
// qkv: (T, (H + 2 Hkv) D), the fused projection's output. cos, sin: (P, D) tables with the
// rotate-half sign folded in (llama.py's Rotary): x' = x * cos + roll(x, D/2) * sin, each
// product and the sum rounded to the dtype as the three tensor ops would. Returns q and k
// rotated, (T, H + Hkv, D); k and v also go to their cache slots.

template <typename T>
void rope_store_impl(const T* qkv, const T* cos, const T* sin, const int64_t* positions,
                     const int64_t* slots, T* k_cache, T* v_cache, T* out, int64_t tokens,
                     int64_t heads, int64_t kv_heads, int64_t D) {
  const int64_t width = (heads + 2 * kv_heads) * D, half = D / 2;
  const int64_t rotated = heads + kv_heads;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + positions[t] * D;
      const T* s = sin + positions[t] * D;
      const T* row = qkv + t * width;
      T* o = out + t * rotated * D;
      for (int64_t h = 0; h < rotated; ++h) {
        const T* x = row + h * D;
        T* y = o + h * D;
        for (int64_t i = 0; i < D; ++i) {
          const float a = stored<T>(widen(x[i]) * widen(c[i]));
          const float b = stored<T>(widen(x[i < half ? i + half : i - half]) * widen(s[i]));
          y[i] = static_cast<T>(a + b);
        }
      }
      const int64_t slot = slots[t];
      std::memcpy(k_cache + slot * kv_heads * D, o + heads * D, kv_heads * D * sizeof(T));
      std::memcpy(v_cache + slot * kv_heads * D, row + rotated * D, kv_heads * D * sizeof(T));
    }
  });
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slots, at::Tensor k_cache,
                      at::Tensor v_cache, int64_t heads, int64_t kv_heads) {
  const int64_t D = cos.size(1), T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.stride(0) == qkv.size(1),
              "qkv must be a contiguous (tokens, width) tensor");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D, "qkv's width does not match the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous (positions, head_dim) tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.size(-1) == D && k_cache.size(-2) == kv_heads, "cache layout mismatch");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == T && slots.numel() == T,
              "positions and slots must be int64, one per token");
  for (const auto& t : {cos, sin, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "tables and caches must be in qkv's dtype");
  auto pc = positions.contiguous();
  auto sc = slots.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.numel() / (kv_heads * D);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " is past the tables");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
  }
  auto out = at::empty({T, heads + kv_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    rope_store_impl(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                    pp, sp, k_cache.data_ptr<scalar_t>(),
                    v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T, heads, kv_heads,
                    D);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// Decode attention over the paged cache in place: no gathered copy, no mask.
//
// q: (B, H, D), one token per sequence; caches (num_blocks, block_size, Hkv, D); tables
// (B, max_blocks) int64; lens (B,) int64, the keys each sequence attends to (with a
// `window` > 0, only the last `window` of them: Gemma's local layers). The G query
// heads that share a K/V head are computed together, so each key is read once for them.
// Work is split into (sequence, span of kSpan keys, K/V head) items, in that order, so a
// thread reads a span's heads one after the other while their lines are near; a sequence's spans
// are fixed by position and combined in order by their log-sum-exp in fp32, so the result
// depends on the sequence alone, never on its batch or the thread count. Scores,
// probabilities and sums stay in fp32; the output is rounded to the dtype once. (Measured
// and not kept: probabilities rounded to the dtype before they weigh V, as PyTorch's flash
// attention does for a prompt. Decodes then agreed with prompt passes more often, but
// greedy replies agreed with the fp32 reference less: 14 of 20 against 15.)

#ifdef __AVX512F__
// Sixteen dot_lanes trees at once: v[i] holds the 16 lane sums of dot product i (its
// first loop in dot_lanes); the result's lane i is dot_lanes' sum for v[p(i)], with the
// same pairs added at each level (lane l + lane l + 8, then + 4, + 2, + 1), so the bits
// are dot_lanes'. Lane 4k + m ends up holding v[k + 4m]: callers put the vector for
// output i at index kReduceSlot[i].
constexpr int kReduceSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline __m512 reduce16(const __m512* v) {
  __m512 w[8], u[4], t[2];
  for (int i = 0; i < 8; ++i)  // lanes l + l + 8 of v[2i] | of v[2i + 1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // + 4: a quad per vector, v[4i .. 4i + 3]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // + 2, within each quad
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__)
// The same with AVX2, eight at a time: v[i] holds lane_sum's lanes l + l + 8 of dot product
// i (its 16 lanes are two 8-wide registers, added first); then + 4, + 2, + 1 as in
// lane_sum. Lane p ends up holding v[kReduceSlot8[p]]: callers put output i there.
constexpr int kReduceSlot8[8] = {0, 2, 4, 6, 1, 3, 5, 7};

inline __m256 reduce8(const __m256* v) {
  __m256 u[4], t[2];
  for (int i = 0; i < 4; ++i)  // + 4: a half per vector, v[2i] | v[2i + 1]
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // + 2, within each half
    t[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                       _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512BF16__)
// Scores of two query vectors a, b (bf16 rows of kD as stored) against 8 keys (K rows as
// stored): vdpbf16ps, 32 products an instruction, in the order widen_qk's layout gives the
// fp32 loops, then the 16 sums reduced together. Lanes 0-7: a's keys; 8-15: b's.
template <int64_t kD>
inline __m512 score_block_bf16(const uint16_t* a, const uint16_t* b, const uint16_t* const* keys) {
  constexpr int64_t kP = kD / 32;
  __m512bh qa[kP], qb[kP];
  for (int64_t c = 0; c < kP; ++c) {
    qa[c] = (__m512bh)_mm512_loadu_si512(a + 32 * c);
    qb[c] = (__m512bh)_mm512_loadu_si512(b + 32 * c);
  }
  __m512 lanes[16];
  for (int i = 0; i < 8; ++i) {
    __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
    for (int64_t c = 0; c < kP; ++c) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(keys[i] + 32 * c);
      acc_a = _mm512_dpbf16_ps(acc_a, qa[c], k);
      acc_b = _mm512_dpbf16_ps(acc_b, qb[c], k);
    }
    lanes[kReduceSlot[i]] = acc_a;
    lanes[kReduceSlot[8 + i]] = acc_b;
  }
  return reduce16(lanes);
}

// out[p] = {in[0][p], ..., in[15][p]}: a 16 x 16 transpose of 32-bit words, in three
// rounds of shuffles (pairs of words, of double words, of 128-bit lanes).
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // lane k of t[2i]: rows 2i, 2i + 1 at words 4k, 4k + 1
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane k of u[4i + m]: rows 4i .. 4i + 3 at word 4k + m
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // out[4k + m]: lane k of u[m], u[4 + m], u[8 + m], u[12 + m]
    const __m512i a0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // lanes 0, 2
    const __m512i a1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // lanes 1, 3
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i b1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    out[m] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    out[8 + m] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
    out[12 + m] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
  }
}

// NV query vectors' scores (bf16 rows of kD as stored) against 16 keys as prefill_span
// copies them (`transposed`): kt[p * 16 + j] holds dims 2p and 2p + 1 of key j. The same
// operations as score_block_bf16, in another arrangement: lane l's sums of the 16 keys are
// one register (each vdpbf16ps takes the query's pair p = 16 c + l, broadcast, against the
// keys' pair p), and dot_lanes' tree (lanes l + l + 8, + 4, + 2, + 1) becomes adds of
// whole registers, where reduce16 needed shuffles to bring the lanes together. So the
// bits are score_block_bf16's, for each vector whatever NV.
//
// Each key register is loaded once for all NV vectors: one vector alone loaded a key
// register for every vdpbf16ps, and the loads, not the products, bounded it. The tree is
// taken depth first, node<W>(l) being its sum at width W (S_W(l) = S_2W(l) + S_2W(l + W),
// S_16(l) = lane l's sums), so that a vector holds ~5 registers at a time, not 16.
template <int64_t kD, int NV>
struct ScoreBlocks {
  static constexpr int64_t kP = kD / 32;
  const uint16_t* const* q;  // NV query rows as stored
  const uint32_t* kt;        // the keys' pairs

  template <int W>
  inline __attribute__((always_inline)) void node(int l, __m512* out) const {
    if constexpr (W == 16) {
      __m512bh keys[kP];
      for (int64_t c = 0; c < kP; ++c)
        keys[c] = (__m512bh)_mm512_loadu_si512(kt + (16 * c + l) * 16);
      for (int v = 0; v < NV; ++v) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < kP; ++c) {
          // The query's pair broadcast (a load) as the second operand: each product is
          // exact, so which operand is which changes nothing.
          const __m512i pair = _mm512_broadcastd_epi32(_mm_loadu_si32(q[v] + 32 * c + 2 * l));
          acc = _mm512_dpbf16_ps(acc, keys[c], (__m512bh)pair);
        }
        out[v] = acc;
      }
    } else {
      __m512 other[NV];
      node<W * 2>(l, out);
      node<W * 2>(l + W, other);
      for (int v = 0; v < NV; ++v) {
        out[v] = _mm512_add_ps(out[v], other[v]);
        // Here, not after every lane's sums: gcc would otherwise hold all 16 NV of them.
        asm volatile("" : "+v"(out[v]));
      }
    }
  }
  inline __attribute__((always_inline)) void scores(__m512* out) const { node<1>(0, out); }
};

// The scores of the NV query vectors at q + at[i] against a block of 16 keys, stored at
// out + i * stride. Not inlined: within prefill_span's body gcc's registers for it spill.
template <int64_t kD, int NV, typename T>
__attribute__((noinline)) void score_group(const T* q, const int64_t* at,
                                           const uint32_t* block, float* out, int64_t stride) {
  const uint16_t* rows[NV];
  for (int i = 0; i < NV; ++i) rows[i] = reinterpret_cast<const uint16_t*>(q + at[i]);
  __m512 s[NV];
  ScoreBlocks<kD, NV>{rows, block}.scores(s);
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + i * stride, s[i]);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// One query vector's scores (widened, kD floats) against 8 widened keys: lane_sum's 16
// lanes as two registers (term d to lane d % 16, low or high half), added first, then
// reduce8. Lane i: key i's.
template <int64_t kD>
inline __m256 score_block8(const float* q, const float* const* keys) {
  __m256 lanes[8];
  for (int i = 0; i < 8; ++i) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t d = 0; d < kD; d += kLanes) {
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys[i] + d)));
      hi = _mm256_add_ps(hi,
                         _mm256_mul_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(keys[i] + d + 8)));
    }
    lanes[kReduceSlot8[i]] = _mm256_add_ps(lo, hi);  // + 8
  }
  return reduce8(lanes);
}
#endif

constexpr int64_t kSpan = 512;

constexpr int64_t kMaxHeadDim = 256;

#ifdef __AVX512F__
// 16 elements of a K or V row widened to fp32 (widen_row's values).
template <typename T>
inline __m512 widen16(const T* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = widen(p[i]);
  return _mm512_load_ps(f);
}
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// decode_span's weighted sum of V for query heads [g0, g0 + KG) and dims [16 c0, 16 (c0 +
// KC)): the KG x KC sums stay in registers across the span's keys, each V row is loaded
// once for all KG heads, and each sum is its own chain of fused multiply-adds in key order
// (the portable loop's operations, so its bits).
template <int KG, int KC, typename T>
inline void weigh_values(const T* v_cache, const int64_t* offsets, int64_t n,
                         const float* scores, int64_t g0, int64_t c0, int64_t D, float* acc) {
  __m512 a[KG][KC];
  for (int k = 0; k < KG; ++k)
    for (int c = 0; c < KC; ++c) a[k][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* p = v_cache + offsets[j] + c0 * kLanes;
    __m512 row[KC];
    for (int c = 0; c < KC; ++c) row[c] = widen16(p + c * kLanes);
    for (int k = 0; k < KG; ++k) {
      const __m512 pj = _mm512_set1_ps(scores[(g0 + k) * n + j]);
      for (int c = 0; c < KC; ++c) a[k][c] = _mm512_fmadd_ps(pj, row[c], a[k][c]);
    }
  }
  for (int k = 0; k < KG; ++k)
    for (int c = 0; c < KC; ++c) _mm512_storeu_ps(acc + (g0 + k) * D + (c0 + c) * kLanes, a[k][c]);
}
#elif defined(__AVX2__)
// The same with AVX2: 8 elements a register, dims [8 c0, 8 (c0 + KC)).
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
template <typename T>
inline __m256 widen8(const T* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = widen(p[i]);
  return _mm256_load_ps(f);
}

template <int KG, int KC, typename T>
inline void weigh_values(const T* v_cache, const int64_t* offsets, int64_t n,
                         const float* scores, int64_t g0, int64_t c0, int64_t D, float* acc) {
  __m256 a[KG][KC];
  for (int k = 0; k < KG; ++k)
    for (int c = 0; c < KC; ++c) a[k][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* p = v_cache + offsets[j] + c0 * 8;
    __m256 row[KC];
    for (int c = 0; c < KC; ++c) row[c] = widen8(p + c * 8);
    for (int k = 0; k < KG; ++k) {
      const __m256 pj = _mm256_set1_ps(scores[(g0 + k) * n + j]);
      for (int c = 0; c < KC; ++c) a[k][c] = _mm256_fmadd_ps(pj, row[c], a[k][c]);
    }
  }
  for (int k = 0; k < KG; ++k)
    for (int c = 0; c < KC; ++c) _mm256_storeu_ps(acc + (g0 + k) * D + (c0 + c) * 8, a[k][c]);
}
#endif

// kD: the head size when known at compile time (the common 64, 128 and 256, whose loops
// vectorize whole), 0 for any other. Either gives the same bits.
//
// With vectors and such a head size, the span's dot products and weighted sum run as
// prefill_span runs a prompt's (the same operations in the same order, so the same bits):
// with AVX-512 BF16, vdpbf16ps on the K rows as stored, 8 keys for two query heads at a
// time (score_block_bf16); with AVX2, 8 widened keys a query head at a time
// (score_block8); V's sums in registers (weigh_values). Otherwise (fp32 K/V on AVX-512, or
// AVX-512 without BF16) a key's G dot products one by one (dot_lanes, lane_sum).
template <typename T, int64_t kD>
void decode_span(const float* q /* G x D, widen_qk */, const T* q_raw /* G x D as stored */,
                 const T* k_cache, const T* v_cache,
                 const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t h,
                 int64_t first, int64_t last, int64_t G, int64_t head_dim, float scale,
                 float* scores, float* max_out, float* sum_out, float* acc /* G x D */) {
  const int64_t D = kD ? kD : head_dim;
  const int64_t n = last - first;
  float row[kMaxHeadDim];
  // Each key's head-h row in either cache, as an offset: a block's rows are kv_heads * D
  // apart, so the table is read once a block, not divided into per key.
  int64_t offsets[kSpan];
  for (int64_t pos = first; pos < last;) {
    const int64_t block = pos / block_size;
    const int64_t stop = std::min(last, (block + 1) * block_size);
    int64_t at = ((table[block] * block_size + pos % block_size) * kv_heads + h) * D;
    for (; pos < stop; ++pos, at += kv_heads * D) offsets[pos - first] = at;
  }
  // The row of key j + ahead, asked for while key j's is read.
  const auto prefetch = [&](const T* cache, int64_t j, int64_t ahead) {
    if (j + ahead < n)
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(cache + offsets[j + ahead]) + b);
  };
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (kPairs<T> && kD > 0 && kD % 32 == 0) {
    // prefill_span's vdpbf16ps blocks: keys j0 .. j0 + 7 (rows of zeros past the span's
    // last), two query heads a block (a last one alone pairs with itself).
    const uint16_t zeros[kD] = {};
    const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
    const auto* qr = reinterpret_cast<const uint16_t*>(q_raw);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const uint16_t* kr[8];
      for (int i = 0; i < 8; ++i) {
        kr[i] = j0 + i < n ? kc + offsets[j0 + i] : zeros;
        prefetch(k_cache, j0 + i, 16);
      }
      const __mmask8 keep = n - j0 >= 8 ? 0xFF : (1u << (n - j0)) - 1;
      for (int64_t v = 0; v < G; v += 2) {
        const int64_t w = std::min(v + 1, G - 1);
        const __m512 out = score_block_bf16<kD>(qr + v * kD, qr + w * kD, kr);
        _mm256_mask_storeu_ps(scores + v * n + j0, keep, _mm512_castps512_ps256(out));
        _mm256_mask_storeu_ps(scores + w * n + j0, keep,
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out), 1)));
      }
    }
  } else
#elif defined(__AVX2__)
  if constexpr (kD > 0 && kD % kLanes == 0) {
    // prefill_span's AVX2 blocks (score_block8): 8 keys widened, a query head at a time.
    alignas(32) float kw[8][kD];
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - j0);
      for (int64_t i = 0; i < 8; ++i) {
        if (i < m) {
          prefetch(k_cache, j0 + i, 16);
          widen_qk(k_cache + offsets[j0 + i], kw[i], kD);
        } else {
          std::fill_n(kw[i], kD, 0.f);
        }
      }
      const float* const rows[8] = {kw[0], kw[1], kw[2], kw[3], kw[4], kw[5], kw[6], kw[7]};
      for (int64_t g = 0; g < G; ++g) {
        alignas(32) float out[8];
        _mm256_store_ps(out, score_block8<kD>(q + g * kD, rows));
        std::copy_n(out, m, scores + g * n + j0);
      }
    }
  } else
#endif
  {
    for (int64_t j = 0; j < n; ++j) {
      prefetch(k_cache, j, 16);
      widen_qk(k_cache + offsets[j], row, D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
#ifdef __AVX512F__
        if constexpr (kD > 0 && kD % kLanes == 0) {
          scores[g * n + j] = dot_lanes<kD>(qg, row);
          continue;
        }
#endif
        scores[g * n + j] = lane_sum(D, [&](int64_t d) { return qg[d] * row[d]; });
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    for (int64_t j = 0; j < n; ++j) sg[j] *= scale;  // after the sum, as prefill_span scales
    const float m = max_of(sg, n);
    exp_shifted(sg, n, m);
    max_out[g] = m;
    sum_out[g] = lane_sum(n, [&](int64_t j) { return sg[j]; });
  }
  // Each key's V added to the sums by a fused multiply-add (one rounding, one instruction),
  // key by key in order: prefill_span does the same for a prompt's rows.
#ifdef __AVX512F__
  if constexpr (kD > 0 && kD % kLanes == 0) {
    constexpr int64_t kC = kD / kLanes, kCc = kC < 8 ? kC : 8, kG = kCc <= 4 ? 4 : 2;
    for (int64_t c0 = 0; c0 < kC; c0 += kCc)
      for (int64_t g0 = 0; g0 < G; g0 += kG) {
        const int64_t heads = std::min(kG, G - g0);
        if (heads == 4) {
          if constexpr (kG == 4) weigh_values<4, kCc>(v_cache, offsets, n, scores, g0, c0, D, acc);
        } else if (heads == 3) {
          if constexpr (kG == 4) weigh_values<3, kCc>(v_cache, offsets, n, scores, g0, c0, D, acc);
        } else if (heads == 2) {
          weigh_values<2, kCc>(v_cache, offsets, n, scores, g0, c0, D, acc);
        } else {
          weigh_values<1, kCc>(v_cache, offsets, n, scores, g0, c0, D, acc);
        }
      }
    return;
  }
#elif defined(__AVX2__)
  if constexpr (kD > 0 && kD % 32 == 0) {  // 32 dims and two heads a pass: 8 sums, 4 rows
    for (int64_t c0 = 0; c0 < kD / 8; c0 += 4)
      for (int64_t g0 = 0; g0 < G; g0 += 2) {
        if (G - g0 >= 2)
          weigh_values<2, 4>(v_cache, offsets, n, scores, g0, c0, D, acc);
        else
          weigh_values<1, 4>(v_cache, offsets, n, scores, g0, c0, D, acc);
      }
    return;
  }
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    prefetch(v_cache, j, 16);
    widen_row(v_cache + offsets[j], row, D);
    for (int64_t g = 0; g < G; ++g) {
      const float pj = scores[g * n + j];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, row[d], a[d]);
    }
  }
}

// One query head's output from its spans' pieces, combined in order by their log-sum-exp
// in fp32 and rounded to the dtype once. piece(s) gives span s's (max, sum, D partial
// sums); o is D floats of scratch. paged_decode and paged_prefill both end here, so a
// position's row combines alike in either.
struct SpanPiece {
  float max, sum;
  const float* partial;
};

template <typename T, typename Piece>
void combine_spans(int64_t spans, int64_t D, Piece piece, float* o, T* y) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < spans; ++s) m = std::max(m, piece(s).max);
  float total = 0.f;
  std::fill_n(o, D, 0.f);
  for (int64_t s = 0; s < spans; ++s) {
    const SpanPiece p = piece(s);
    const float w = spans == 1 ? 1.0f : exp_neg(p.max - m);
    total += w * p.sum;
    for (int64_t d = 0; d < D; ++d) o[d] += w * p.partial[d];
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(o[d] * inv);
}

// The first key a query at `position` attends to: 0, or with a sliding window (Gemma's
// local layers) the oldest of the window's last `window` positions.
inline int64_t window_start(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
}

// ---------------------------------------------------------------------------------------
// Attention on AMX (bf16, head size 64), where the linears run on it too (qmatmul.cpp's
// switch: PARLEY_AMX=0 turns both off). A span's scores and its weighted sum of V are
// tile products; what lies between them (scale, max, exp, sum) is the vector code above.
// paged_decode and paged_prefill both compute a query vector's span here, alone in its
// tile row, over key blocks aligned to the span's start: a vector's bits depend on its
// query, its keys and its bounds only, never on its tile's other rows, so a decode, a
// chunk and a whole prompt agree as they do on the vector path.
//
// Scores: a tile of 16 query vectors (32 dims a tile) against 16 keys, the K rows turned
// into the tile unit's pairs (dims 2i, 2i + 1 of 16 keys in row i). The probabilities are
// split into two bf16 parts, hi = bf16(p) and lo = bf16(p - hi) (p to ~16 bits instead of
// 8: probabilities rounded to bf16 alone cost greedy agreement with the fp32 reference,
// above), and both weigh V, 32 keys a tile, V's rows paired key by key (keys 2i, 2i + 1 in
// row i). A vector's masked keys weigh V by exact zeros (V's rows past the span's keys are
// zeros), so adding them changes no sum.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define PARLEY_AMX_ATTENTION 1
#endif

#ifdef PARLEY_AMX_ATTENTION
constexpr int64_t kAmxD = 64, kAmxVecs = 16;

struct alignas(64) AttnTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: C tiles 16 x 16 fp32, A and B 16 x 32 bf16.
inline void amx_attention_tiles() {
  AttnTileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// K: 16 keys' rows (32 dim pairs each) to their two B tiles, tile c's row i holding pair
// 16c + i of each key: a 16 x 16 transpose of 32-bit pairs per tile, in registers.
inline void transpose_keys(const uint32_t (*keys)[kAmxD / 2], uint32_t* kt) {
  for (int c = 0; c < 2; ++c) {
    __m512 r[16], t[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_castsi512_ps(_mm512_load_si512(keys[k] + 16 * c));
    for (int k = 0; k < 16; k += 2) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
      t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
      t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {  // per lane: pairs 0..3 of keys k..k + 3
      const auto lo = [](__m512 a, __m512 b) {
        return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
      };
      const auto hi = [](__m512 a, __m512 b) {
        return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
      };
      r[k] = lo(t[k], t[k + 2]);
      r[k + 1] = hi(t[k], t[k + 2]);
      r[k + 2] = lo(t[k + 1], t[k + 3]);
      r[k + 3] = hi(t[k + 1], t[k + 3]);
    }
    // r[4q + m]: lane L holds pair 4L + m of keys 4q .. 4q + 3.
    for (int m = 0; m < 4; ++m) {
      t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);  // pairs m, 8 + m of keys 0-7
      t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);  // pairs 4 + m, 12 + m
      t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);  // of keys 8-15
      t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    }
    // t[p] (p < 8) holds pairs p and p + 8 of keys 0-7, t[8 + p] of keys 8-15.
    float* out = reinterpret_cast<float*>(kt + c * 256);
    for (int p = 0; p < 8; ++p) {
      _mm512_storeu_ps(out + p * 16, _mm512_shuffle_f32x4(t[p], t[8 + p], 0x88));
      _mm512_storeu_ps(out + (p + 8) * 16, _mm512_shuffle_f32x4(t[p], t[8 + p], 0xdd));
    }
  }
}

// A span's K and V as tile operands, keys [from, to) of the span at `first` (offsets from
// it; from and to multiples of 32), keys outside [valid_from, valid_to) zero. kt: per 16
// keys and 32 dims a B tile (row i: dims 2i, 2i + 1 of each key); vt: per 32 keys and 16
// dims a B tile (row i: keys 2i, 2i + 1 of each dim).
template <typename T>
void amx_span_operands(const T* k_cache, const T* v_cache, const int64_t* table,
                       int64_t block_size, int64_t kv_heads, int64_t h, int64_t first,
                       int64_t from, int64_t to, int64_t valid_from, int64_t valid_to,
                       uint32_t* kt, uint32_t* vt) {
  constexpr int64_t D = kAmxD;
  alignas(64) static const uint16_t zero[D] = {};
  alignas(64) uint32_t keys[16][D / 2];  // 16 keys' rows, then turned into their tiles
  // V's word interleave: words 0-15 of one row with those of the next, then words 16-31.
  const __m512i lo_idx = [] {
    alignas(64) uint16_t i[32];
    for (int k = 0; k < 16; ++k) i[2 * k] = k, i[2 * k + 1] = 32 + k;
    return _mm512_load_si512(i);
  }();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t j = from; j < to; j += 2) {
    const uint16_t *kr[2], *vr[2];  // keys j, j + 1: their rows, or zeros
    for (int e = 0; e < 2; ++e) {
      const int64_t key = j + e, pos = first + key;
      kr[e] = vr[e] = zero;
      if (key >= valid_from && key < valid_to) {  // past them the table may end
        const int64_t at =
            ((table[pos / block_size] * block_size + pos % block_size) * kv_heads + h) * D;
        kr[e] = reinterpret_cast<const uint16_t*>(k_cache + at);
        vr[e] = reinterpret_cast<const uint16_t*>(v_cache + at);
      }
      std::memcpy(keys[key % 16], kr[e], D * 2);
      if (key % 16 == 15) transpose_keys(keys, kt + (key / 16) * 2 * 256);
    }
    // V: keys j, j + 1 interleaved dim by dim: tile (j / 32, d / 16), row (j % 32) / 2.
    const __m512i a = _mm512_loadu_si512(vr[0]), b = _mm512_loadu_si512(vr[0] + 32);
    const __m512i c = _mm512_loadu_si512(vr[1]), d = _mm512_loadu_si512(vr[1] + 32);
    uint32_t* vb = vt + (j / 32) * 4 * 256 + ((j % 32) / 2) * 16;
    _mm512_storeu_si512(vb + 0 * 256, _mm512_permutex2var_epi16(a, lo_idx, c));
    _mm512_storeu_si512(vb + 1 * 256, _mm512_permutex2var_epi16(a, hi_idx, c));
    _mm512_storeu_si512(vb + 2 * 256, _mm512_permutex2var_epi16(b, lo_idx, d));
    _mm512_storeu_si512(vb + 3 * 256, _mm512_permutex2var_epi16(b, hi_idx, d));
  }
}

// Up to 16 query vectors (q: 16 rows of D bf16, rows past `vecs` anything finite) over a
// span's operands, keys [from, to): vector v attends to keys [lo[v], hi[v]) (offsets from
// the span's start). Unless it has no key there, out.put(v, max, sum) receives its
// softmax pieces and out.at(v) (D floats) its partial sums. scores: 16 x kSpan floats;
// phi, plo: 16 x kSpan bf16 each.
template <typename Out>
void amx_span_vectors(const uint16_t* q, int64_t vecs, const int64_t* lo, const int64_t* hi,
                      const uint32_t* kt, const uint32_t* vt, int64_t from, int64_t to,
                      float scale, float* scores, uint16_t* phi, uint16_t* plo, Out out) {
  constexpr int64_t D = kAmxD, ldq = D * 2, lds = kSpan * 4, ldp = kSpan * 2;
  _tile_loadd(4, q, ldq);
  _tile_loadd(5, q + 32, ldq);
  for (int64_t kb = from / 16; kb < to / 16; kb += 2) {  // to - from: a multiple of 32
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, kt + kb * 512, 64);
    _tile_loadd(7, kt + kb * 512 + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(6, kt + (kb + 1) * 512, 64);
    _tile_loadd(7, kt + (kb + 1) * 512 + 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, scores + kb * 16, lds);
    _tile_stored(1, scores + kb * 16 + 16, lds);
  }
  // Rows past `vecs` keep what an earlier call left there (finite): their sums are not read.
  for (int64_t v = 0; v < vecs; ++v) {
    uint16_t* ph = phi + v * kSpan;
    uint16_t* pl = plo + v * kSpan;
    std::fill(ph + from, ph + to, uint16_t{0});
    std::fill(pl + from, pl + to, uint16_t{0});
    if (hi[v] <= lo[v]) continue;
    // Two passes over the vector's scores, each scaled after its sum as decode_span's:
    // their max (exact in any order: two chains), then p = exp(s - max), its sum as
    // lane_sum adds (16 lanes by key, then halvings) and its two bf16 parts (both RNE).
    const int64_t nv = hi[v] - lo[v];
    const float* sv = scores + v * kSpan + lo[v];
    const auto mask = [&](int64_t j) -> __mmask16 {
      return nv - j >= 16 ? 0xffff : (1u << (nv - j)) - 1;
    };
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 m2[2] = {ninf, ninf};
    for (int64_t j = 0; j < nv; j += 16)
      m2[(j / 16) % 2] = _mm512_max_ps(
          m2[(j / 16) % 2],
          _mm512_mask_mul_ps(ninf, mask(j), _mm512_maskz_loadu_ps(mask(j), sv + j), vs));
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(m2[0], m2[1]));
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < nv; j += 16) {
      const __mmask16 k = mask(j);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sv + j), vs);
      const __m512 p = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(x, vm)));
      acc = _mm512_add_ps(acc, p);  // a tail's missing lanes add +0: no change
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(p);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hf));
      _mm256_mask_storeu_epi16(ph + lo[v] + j, k, h);
      _mm256_mask_storeu_epi16(pl + lo[v] + j, k, l);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc);
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    out.put(v, m, lanes[0]);
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = from / 32; b < to / 32; ++b) {
    _tile_loadd(4, phi + b * 32, ldp);
    _tile_loadd(5, plo + b * 32, ldp);
    const uint32_t* vb = vt + b * 4 * 256;
    _tile_loadd(6, vb, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 6);
    _tile_loadd(7, vb + 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, vb + 512, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, vb + 768, 64);
    _tile_dpbf16ps(3, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sums[kAmxVecs][D];
  _tile_stored(0, &sums[0][0], D * 4);
  _tile_stored(1, &sums[0][16], D * 4);
  _tile_stored(2, &sums[0][32], D * 4);
  _tile_stored(3, &sums[0][48], D * 4);
  for (int64_t v = 0; v < vecs; ++v)
    if (hi[v] > lo[v]) std::memcpy(out.at(v), sums[v], D * sizeof(float));
}

// The scratch a thread's AMX spans use, kept from call to call.
struct AmxScratch {
  std::vector<uint32_t> kt, vt;
  std::vector<float> scores;
  std::vector<uint16_t> phi, plo, q;
  AmxScratch()
      : kt(kSpan * kAmxD / 2), vt(kSpan * kAmxD / 2), scores(kAmxVecs * kSpan),
        phi(kAmxVecs * kSpan), plo(kAmxVecs * kSpan), q(kAmxVecs * kAmxD) {}
};
#endif

// Whether paged_decode and paged_prefill take the AMX path: the same answer for both, so
// that a decode and a prompt agree (G: query heads a K/V head, at most a tile's rows).
template <typename T>
bool amx_attention(int64_t D, int64_t G) {
#ifdef PARLEY_AMX_ATTENTION
  return std::is_same_v<T, c10::BFloat16> && D == kAmxD && G <= kAmxVecs &&
         parley_kernels::amx_enabled();
#else
  return false;
#endif
}

template <typename T>
void paged_decode_impl(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                       const int64_t* lens, T* out, int64_t B, int64_t H, int64_t kv_heads,
                       int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                       int64_t window) {
  const int64_t G = H / kv_heads;
  // Items: (sequence, K/V head, span), over the spans that hold a key the sequence attends
  // to (all of them without a window). first_item[b] is sequence b's first.
  std::vector<int64_t> first_item(B + 1, 0), first_span(B);
  for (int64_t b = 0; b < B; ++b) {
    first_span[b] = window_start(lens[b] - 1, window) / kSpan;
    const int64_t spans = (lens[b] + kSpan - 1) / kSpan - first_span[b];
    first_item[b + 1] = first_item[b] + kv_heads * spans;
  }
  const int64_t items = first_item[B];
  // Per item: its max and sum for each of G rows, and G x D partial outputs.
  std::vector<float> stats(items * 2 * G), partial(items * G * D);
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) keys += lens[b] - window_start(lens[b] - 1, window);
  // Small steps run on the calling thread (a grain above the count): waking the pool
  // costs more than the work.
  const int64_t grain = keys * kv_heads < 512 ? items + 1 : 1;
#ifdef PARLEY_AMX_ATTENTION
  if (amx_attention<T>(D, G)) {
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
      thread_local AmxScratch s;
      amx_attention_tiles();  // another library's tile code may have run on this thread
      int64_t b = std::upper_bound(first_item.begin(), first_item.end(), begin) -
                  first_item.begin() - 1;
      for (int64_t it = begin; it < end; ++it) {
        while (it >= first_item[b + 1]) ++b;
        const int64_t span = first_span[b] + (it - first_item[b]) / kv_heads;
        const int64_t h = (it - first_item[b]) % kv_heads, base = span * kSpan;
        // The span's keys as offsets from its start, as paged_prefill's rows see them.
        const int64_t lo = std::max<int64_t>(0, window_start(lens[b] - 1, window) - base);
        const int64_t hi = std::min(lens[b], base + kSpan) - base;
        const int64_t from = lo / 32 * 32, to = (hi + 31) / 32 * 32;
        amx_span_operands(k_cache, v_cache, tables + b * max_blocks, block_size, kv_heads, h,
                          base, from, to, lo, hi, s.kt.data(), s.vt.data());
        std::memcpy(s.q.data(), q + (b * H + h * G) * D, G * D * sizeof(T));
        int64_t los[kAmxVecs], his[kAmxVecs];
        std::fill_n(los, G, lo);
        std::fill_n(his, G, hi);
        float* st = stats.data() + it * 2 * G;
        float* pa = partial.data() + it * G * D;
        struct {
          float* st;
          float* pa;
          int64_t G;
          void put(int64_t v, float m, float sum) { st[v] = m, st[G + v] = sum; }
          float* at(int64_t v) { return pa + v * kAmxD; }
        } out{st, pa, G};
        amx_span_vectors(s.q.data(), G, los, his, s.kt.data(), s.vt.data(), from, to, scale,
                         s.scores.data(), s.phi.data(), s.plo.data(), out);
      }
      _tile_release();
    });
  } else
#endif
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * kSpan);
    int64_t b = std::upper_bound(first_item.begin(), first_item.end(), begin) -
                first_item.begin() - 1;
    for (int64_t it = begin; it < end; ++it) {
      while (it >= first_item[b + 1]) ++b;
      const int64_t span = first_span[b] + (it - first_item[b]) / kv_heads;
      const int64_t h = (it - first_item[b]) % kv_heads;
      const T* qb = q + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) widen_qk(qb + g * D, qf.data() + g * D, D);
      const int64_t first = std::max(span * kSpan, window_start(lens[b] - 1, window));
      const int64_t last = std::min(lens[b], span * kSpan + kSpan);
      float* st = stats.data() + it * 2 * G;
      const auto span_fn = D == 64    ? decode_span<T, 64>
                           : D == 128 ? decode_span<T, 128>
                           : D == 256 ? decode_span<T, 256>
                                      : decode_span<T, 0>;
      span_fn(qf.data(), qb, k_cache, v_cache, tables + b * max_blocks, block_size, kv_heads, h,
              first, last, G, D, scale, scores.data(), st, st + G,
              partial.data() + it * G * D);
    }
  });
  // Combine each (sequence, K/V head)'s spans in order.
  const int64_t heads_total = B * kv_heads;
  at::parallel_for(0, heads_total, items == heads_total ? heads_total + 1 : 1, [&](int64_t begin,
                                                                                  int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads;
      const int64_t spans = (first_item[b + 1] - first_item[b]) / kv_heads;
      const auto item = [&](int64_t s) { return first_item[b] + s * kv_heads + h; };
      for (int64_t g = 0; g < G; ++g) {
        const auto piece = [&](int64_t s) {
          const float* st = stats.data() + item(s) * 2 * G;
          return SpanPiece{st[g], st[G + g], partial.data() + (item(s) * G + g) * D};
        };
        combine_spans(spans, D, piece, o.data(), out + (b * H + h * G + g) * D);
      }
    }
  });
}

// The operands paged_decode and paged_prefill share: q (rows, H, D), contiguous caches
// (blocks, block_size, kv_heads, D) of q's dtype. `rows` names q's first dimension.
void check_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const char* rows) {
  TORCH_CHECK(q.dim() == 3, "q must be (", rows, ", heads, head_dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "heads do not match the cache");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
}

// Every block a table names for its first `keys` keys lies in the cache.
void check_blocks(const int64_t* table, int64_t keys, int64_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < (keys + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block ", table[i],
                " is outside the cache");
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  check_attention(q, k_cache, v_cache, "sequences");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong,
              "tables must be (sequences, max_blocks) int64");
  TORCH_CHECK(lens.numel() == B && lens.scalar_type() == at::kLong, "lens must be int64, one "
              "per sequence");
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto lc = lens.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tc.size(1) * block_size,
                "a sequence's length exceeds its block table");
    check_blocks(tp + b * tc.size(1), lp[b], block_size, k_cache.size(0));
  }
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    paged_decode_impl(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                      v_cache.data_ptr<scalar_t>(), tp, lp,
                      out.data_ptr<scalar_t>(), B, H, kv_heads, D, block_size, tc.size(1),
                      static_cast<float>(scale), window);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// Prompt attention over the paged cache in place, row for row as paged_decode computes it.
//
// q: (n, H, D), n consecutive positions of one sequence, the first at `start`, their K/V
// already in the cache; table: (blocks,) int64, the sequence's block table. Row r attends
// to keys 0 .. start + r, causal (with a `window` > 0, to the last `window` of them). Each
// row's result is the bits paged_decode gives a decode at that position: the same spans of
// kSpan keys, the same dot products, the same softmax and the same combine, in the same
// order. So how a prompt is cut into chunks,
// what was cached before it, and whether a token was decoded or came in a prompt change
// nothing in its attention. (PyTorch's flash kernel rounds a row by the shape of its call:
// a chunk of a few rows after a cached prefix, or a decode, comes out in other bits than
// the same row in the whole prompt's pass.)
//
// Work is split into (tile of rows, K/V head) items. An item takes its spans in order,
// widening each span's K and V rows to fp32 once for all its rows' G query heads, then
// combines each row's spans; what it keeps is bounded by its tile, whatever the context.
// With AVX-512 (AVX2), a key block's 16 (8) dot products are reduced together (reduce16,
// reduce8 above; with AVX-512 BF16, ScoreBlocks' adds of whole registers), with the same
// additions as dot_lanes (lane_sum) makes for each alone.

constexpr int64_t kTileRows = 32, kMaxTileRows = 48;

// One item: rows [r0, r1) of the chunk (positions start + r), K/V head h, keys
// [first, first + kSpan). For each row r and query head g: its span max, sum and G x D
// partial output at stats / partial, laid out as paged_decode's. A row attends to the
// span's keys [lower(r), keys(r)) (offsets from `first`): those up to its position, and
// with a window only its window's.
template <typename T, int64_t kD>
void prefill_span(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t block_size, int64_t kv_heads, int64_t H, int64_t h, int64_t start,
                  int64_t r0, int64_t r1, int64_t first, int64_t G, int64_t head_dim,
                  float scale, int64_t window, float* kf, float* vf, float* qf, float* scores,
                  float* stats, float* partial) {
  const int64_t D = kD ? kD : head_dim;
  // Rows are in order, so both bounds ascend with r: the last row's keys(r) is the most,
  // the first row's lower(r) the least.
  const auto keys = [&](int64_t r) {
    return std::max<int64_t>(0, std::min(start + r + 1, first + kSpan) - first);
  };
  const auto lower = [&](int64_t r) {
    return std::clamp<int64_t>(window_start(start + r, window) - first, 0, kSpan);
  };
  const int64_t n = keys(r1 - 1);
  // Keys before the first row's window are neither read nor copied; the copy starts at a
  // multiple of 16 (the score blocks' 8 or 16) so that every key a block reads was written.
  const int64_t least = std::min(n, lower(r0) / 16 * 16);
  // The span's K and V rows of head h, widened to fp32 once for all the tile's vectors,
  // then 16 rows of zeros (a block of dot products may read past a row's last key).
#if defined(__AVX512BF16__)
  // With AVX-512 BF16 the dot products take the K rows as stored (vdpbf16ps), each 16
  // keys' pairs of dims transposed into kf's memory (ScoreBlocks), from key `least` on.
  constexpr bool kDot = kPairs<T> && kD > 0 && kD % 32 == 0;
#else
  constexpr bool kDot = false;
#endif
  uint32_t* kt = reinterpret_cast<uint32_t*>(kf);
  const auto transposed = [&](int64_t j) {  // where key j's pair 0 goes; pair p at + 16 p
    return kt + (j - least) / 16 * (kD / 2) * 16 + (j - least) % 16;
  };
  const auto row_at = [&](int64_t pos) {
    return ((table[pos / block_size] * block_size + pos % block_size) * kv_heads + h) * D;
  };
#if defined(__AVX512BF16__)
  if constexpr (kDot) {
    // 16 keys at a time: their rows' pairs as 16 x 16 blocks of words, transposed in
    // registers (transpose16); the last block's keys past n as rows of zeros.
    static const uint32_t zeros[kMaxHeadDim / 2] = {};
    for (int64_t j0 = least; j0 < n; j0 += 16) {
      const uint32_t* src[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = j0 + i;
        if (j < n) {
          const int64_t at = row_at(first + j);
          src[i] = reinterpret_cast<const uint32_t*>(k_cache + at);
          widen_row(v_cache + at, vf + j * D, D);
        } else {
          src[i] = zeros;
        }
      }
      uint32_t* to = transposed(j0);
      for (int64_t c = 0; c < kD / 32; ++c) {
        __m512i in[16], out[16];
        for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_si512(src[i] + 16 * c);
        transpose16(in, out);
        for (int l = 0; l < 16; ++l) _mm512_storeu_si512(to + (16 * c + l) * 16, out[l]);
      }
    }
  } else
#endif
  {
    for (int64_t pos = first + least; pos < first + n; ++pos) {
      const int64_t at = row_at(pos);
      widen_qk(k_cache + at, kf + (pos - first) * D, D);
      widen_row(v_cache + at, vf + (pos - first) * D, D);
    }
    std::fill_n(kf + n * D, 16 * D, 0.f);
  }
  std::fill_n(vf + n * D, 16 * D, 0.f);
  const int64_t rows = r1 - r0, qvecs = rows * G;
  // Each query vector's keys, [lo[v], hi[v]), and where it is in q: its row's (vector v is
  // row r0 + v / G, query head h * G + v % G), found once here rather than divided out in
  // the loops below.
  thread_local std::vector<int64_t> bounds;
  if (static_cast<int64_t>(bounds.size()) < 3 * qvecs) bounds.resize(3 * qvecs);
  int64_t *lo = bounds.data(), *hi = lo + qvecs, *at_q = hi + qvecs;
  for (int64_t r = 0, v = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g, ++v) {
      lo[v] = lower(r0 + r), hi[v] = keys(r0 + r);
      at_q[v] = ((r0 + r) * H + h * G + g) * D;
    }
  if constexpr (!kDot)
    for (int64_t v = 0; v < qvecs; ++v) widen_qk(q + at_q[v], qf + v * D, D);
  // Scores, for each query vector its row's keys (rounded up to 8). With AVX-512, two query
  // vectors at a time over a block of 8 keys (each K row loaded once for both), their 16
  // dot products reduced together; the tile's K block stays in L1 for all its vectors.
#if defined(__AVX512BF16__)
  if constexpr (kDot) {
    // vdpbf16ps on the rows as stored: 32 products an instruction, in the order widen_qk's
    // layout gives the fp32 loops; a query vector over a block of 16 keys at a time, the
    // block's keys in L1 for all the tile's vectors. (The block is 16-aligned from
    // `least`, and least, a multiple of 16, and n <= kSpan keep it inside a score row.)
    // kNV vectors a block share its key registers (ScoreBlocks; 6 measured faster than 4,
    // and 3 or 8 slower); a group's vectors that do not reach the block get their scores
    // there too, which they never read.
    constexpr int kNV = 6;
    for (int64_t j0 = least; j0 < n; j0 += 16) {
      const uint32_t* block = transposed(j0);
      int64_t v = 0;
      for (; v + kNV <= qvecs; v += kNV) {
        // rows ascend: the group's last vector reaches furthest, its first starts earliest
        if (j0 >= hi[v + kNV - 1] || j0 + 16 <= lo[v]) continue;
        score_group<kD, kNV>(q, at_q + v, block, scores + v * kSpan + j0, kSpan);
      }
      for (; v < qvecs; ++v) {
        if (j0 >= hi[v] || j0 + 16 <= lo[v]) continue;
        score_group<kD, 1>(q, at_q + v, block, scores + v * kSpan + j0, kSpan);
      }
    }
  } else
#endif
#ifdef __AVX512F__
  if constexpr (kD > 0 && kD % kLanes == 0) {
    constexpr int64_t kC = kD / kLanes;
    for (int64_t j0 = least; j0 < n; j0 += 8) {
      for (int64_t v = 0; v < qvecs; v += 2) {
        const int64_t w = std::min(v + 1, qvecs - 1);  // a last vector alone pairs with itself
        // w's row is v's or after it: the most keys, and the window's start the latest
        if (j0 >= hi[w] || j0 + 8 <= lo[v]) continue;
        __m512 qa[kC], qb[kC], lanes[16];
        for (int64_t c = 0; c < kC; ++c) {
          qa[c] = _mm512_loadu_ps(qf + v * kD + c * kLanes);
          qb[c] = _mm512_loadu_ps(qf + w * kD + c * kLanes);
        }
        for (int i = 0; i < 8; ++i) {
          const float* kr = kf + (j0 + i) * kD;
          __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
          for (int64_t c = 0; c < kC; ++c) {
            const __m512 k = _mm512_loadu_ps(kr + c * kLanes);
            acc_a = _mm512_add_ps(acc_a, _mm512_mul_ps(qa[c], k));
            acc_b = _mm512_add_ps(acc_b, _mm512_mul_ps(qb[c], k));
          }
          lanes[kReduceSlot[i]] = acc_a;  // output lanes 0-7: v's keys; 8-15: w's
          lanes[kReduceSlot[8 + i]] = acc_b;
        }
        const __m512 out = reduce16(lanes);
        _mm256_storeu_ps(scores + v * kSpan + j0, _mm512_castps512_ps256(out));
        _mm256_storeu_ps(scores + w * kSpan + j0,
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out), 1)));
      }
    }
  } else
#elif defined(__AVX2__)
  if constexpr (kD > 0 && kD % kLanes == 0) {
    // One query vector at a time over a block of 8 keys (score_block8).
    for (int64_t j0 = least; j0 < n; j0 += 8) {
      const float* kr[8];
      for (int i = 0; i < 8; ++i) kr[i] = kf + (j0 + i) * kD;
      for (int64_t v = 0; v < qvecs; ++v) {
        if (j0 >= hi[v] || j0 + 8 <= lo[v]) continue;
        _mm256_storeu_ps(scores + v * kSpan + j0, score_block8<kD>(qf + v * kD, kr));
      }
    }
  } else
#endif
  {
    for (int64_t v = 0; v < qvecs; ++v) {
      const int64_t nv = hi[v];
      const float* qv = qf + v * D;
      for (int64_t j = lo[v]; j < nv; ++j) {
        const float* kr = kf + j * D;
        scores[v * kSpan + j] = lane_sum(D, [&](int64_t d) { return qv[d] * kr[d]; });
      }
    }
  }
  // Softmax pieces and the weighted sum of V, each query vector over its own keys.
  for (int64_t v = 0; v < qvecs; ++v) {
    const int64_t r = r0 + v / G, g = v % G, lv = lower(r), nv = keys(r) - lv;
    float* st = stats + (r - r0) * 2 * G;
    float* a = partial + ((r - r0) * G + g) * D;
    if (nv <= 0) {  // a row before this span, or one whose window starts after it: nothing
      continue;     // to add (its combine skips the span)
    }
    float* sv = scores + v * kSpan + lv;  // from its first key, as decode_span's scores
    for (int64_t j = 0; j < nv; ++j) sv[j] *= scale;  // after the sum, as decode_span scales
    const float m = max_of(sv, nv);
    exp_shifted(sv, nv, m);
    st[g] = m;
    st[G + g] = lane_sum(nv, [&](int64_t j) { return sv[j]; });
    std::fill(a, a + D, 0.f);
  }
  // The weighted sum of V, key by key in order for each query vector by fused
  // multiply-adds (as decode_span), 32 keys (8 KB of V, in L1) at a time for all of them.
  // With AVX-512, kGroup vectors together over the keys they all have, so each V row is
  // loaded once for them (and kept in registers) and their sums are independent chains
  // (one vector's kD / 16 chains alone wait on the FMAs' latency).
  constexpr int64_t kBlock = 32;
  const auto out_of = [&](int64_t v) {
    return partial + v * D;  // row r0 + v / G, query head v % G
  };
  const auto start_of = [&](int64_t v, int64_t j0) {
    return std::max(lo[v], j0);
  };
  const auto stop_of = [&](int64_t v, int64_t j0) {
    return std::min(hi[v], j0 + kBlock);
  };
  // a += p_j * v_j for j in [from, to), one vector: the portable loop.
  const auto single = [&](int64_t v, int64_t from, int64_t to) {
    float* a = out_of(v);
    const float* sv = scores + v * kSpan;
    for (int64_t j = from; j < to; ++j) {
      const float pj = sv[j];
      const float* vr = vf + j * D;
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, vr[d], a[d]);
    }
  };
  for (int64_t j0 = least; j0 < n; j0 += kBlock) {
    int64_t v = 0;
#ifdef __AVX512F__
    if constexpr (kD > 0 && kD % kLanes == 0) {
      constexpr int64_t kC = kD / kLanes, kGroup = kD <= 64 ? 4 : 2;
      // Vectors of dims a pass, so that the sums and V's row stay in registers (a 256-wide
      // head in two passes): each dim's chain of FMAs is its own, so the bits are one pass's.
      constexpr int64_t kCc = kC < 8 ? kC : 8;
      for (; v + kGroup <= qvecs; v += kGroup) {
        // The keys all kGroup vectors have: rows ascend, so from the last one's start to the
        // first one's stop. Each vector's keys before and after them go one by one, so that
        // every vector adds its keys in order.
        const int64_t from = start_of(v + kGroup - 1, j0);
        const int64_t common = std::max(from, stop_of(v, j0));
        for (int64_t k = 0; k < kGroup; ++k)
          single(v + k, start_of(v + k, j0), std::min(from, stop_of(v + k, j0)));
        for (int64_t c0 = 0; common > from && c0 < kC; c0 += kCc) {
          __m512 acc[kGroup][kCc];
          for (int64_t k = 0; k < kGroup; ++k)
            for (int64_t c = 0; c < kCc; ++c)
              acc[k][c] = _mm512_loadu_ps(out_of(v + k) + (c0 + c) * kLanes);
          for (int64_t j = from; j < common; ++j) {
            const float* vr = vf + j * kD + c0 * kLanes;
            __m512 row[kCc];
            for (int64_t c = 0; c < kCc; ++c) {
              row[c] = _mm512_loadu_ps(vr + c * kLanes);
              asm("" : : "v"(row[c]));  // in a register: gcc would load it for every FMA
            }
            for (int64_t k = 0; k < kGroup; ++k) {
              const __m512 pj = _mm512_set1_ps(scores[(v + k) * kSpan + j]);
              for (int64_t c = 0; c < kCc; ++c)
                acc[k][c] = _mm512_fmadd_ps(pj, row[c], acc[k][c]);
            }
          }
          for (int64_t k = 0; k < kGroup; ++k)
            for (int64_t c = 0; c < kCc; ++c)
              _mm512_storeu_ps(out_of(v + k) + (c0 + c) * kLanes, acc[k][c]);
        }
        for (int64_t k = 0; k < kGroup; ++k)
          single(v + k, std::max(common, start_of(v + k, j0)), stop_of(v + k, j0));
      }
    }
#elif defined(__AVX2__)
    if constexpr (kD == 64) {  // a vector's 64 sums in 8 registers: 8 chains of adds
      for (; v < qvecs; ++v) {
        const int64_t from = start_of(v, j0), stop = stop_of(v, j0);
        if (stop <= from) continue;
        float* a = out_of(v);
        const float* sv = scores + v * kSpan;
        __m256 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(a + 8 * c);
        for (int64_t j = from; j < stop; ++j) {
          const __m256 pj = _mm256_set1_ps(sv[j]);
          const float* vr = vf + j * kD;
          for (int c = 0; c < 8; ++c)
            acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * c, acc[c]);
      }
    }
#endif
    for (; v < qvecs; ++v) single(v, start_of(v, j0), stop_of(v, j0));
  }
}

#ifdef PARLEY_AMX_ATTENTION
// prefill_span's item on AMX: the tile's rows' query vectors, 16 at a time, over the span's
// operands (made once for them all); each vector's keys and outputs as prefill_span's.
template <typename T>
void amx_prefill_span(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                      int64_t block_size, int64_t kv_heads, int64_t H, int64_t h, int64_t start,
                      int64_t r0, int64_t r1, int64_t first, int64_t G, float scale,
                      int64_t window, float* stats, float* partial) {
  constexpr int64_t D = kAmxD;
  const auto keys = [&](int64_t r) {
    return std::max<int64_t>(0, std::min(start + r + 1, first + kSpan) - first);
  };
  const auto lower = [&](int64_t r) {
    return std::clamp<int64_t>(window_start(start + r, window) - first, 0, kSpan);
  };
  const int64_t least = lower(r0), n = keys(r1 - 1);  // rows ascend: both bounds do
  if (n <= least) return;
  const int64_t from = least / 32 * 32, to = (n + 31) / 32 * 32;
  thread_local AmxScratch s;
  amx_span_operands(k_cache, v_cache, table, block_size, kv_heads, h, first, from, to, least,
                    n, s.kt.data(), s.vt.data());
  const int64_t qvecs = (r1 - r0) * G;
  for (int64_t v0 = 0; v0 < qvecs; v0 += kAmxVecs) {
    const int64_t vecs = std::min(kAmxVecs, qvecs - v0);
    int64_t los[kAmxVecs], his[kAmxVecs];
    for (int64_t i = 0; i < vecs; ++i) {
      const int64_t v = v0 + i, r = r0 + v / G;
      std::memcpy(s.q.data() + i * D, q + (r * H + h * G + v % G) * D, D * sizeof(T));
      los[i] = lower(r);
      his[i] = keys(r);
    }
    struct {
      float* stats;
      float* partial;
      int64_t G, v0;
      void put(int64_t i, float m, float sum) {
        const int64_t v = v0 + i;
        float* st = stats + (v / G) * 2 * G;
        st[v % G] = m, st[G + v % G] = sum;
      }
      float* at(int64_t i) { return partial + (v0 + i) * kAmxD; }
    } out{stats, partial, G, v0};
    amx_span_vectors(s.q.data(), vecs, los, his, s.kt.data(), s.vt.data(), from, to, scale,
                     s.scores.data(), s.phi.data(), s.plo.data(), out);
  }
}
#endif

template <typename T>
void paged_prefill_impl(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                        T* out, int64_t n, int64_t start, int64_t H, int64_t kv_heads, int64_t D,
                        int64_t block_size, float scale, int64_t window) {
  const int64_t G = H / kv_heads;
  // Rows a tile: enough tiles for each thread to have two (tile, head) items, and rows of
  // a short chunk (a follow-up) in few tiles, so that each span's K/V is widened few times.
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = (2 * threads + kv_heads - 1) / kv_heads;
  // On AMX a span's K and V are made into tiles once an item and its rows are cheap: the
  // most rows a tile.
  const int64_t most = amx_attention<T>(D, G) ? kMaxTileRows : kTileRows;
  const int64_t tile = std::max<int64_t>(
      1, std::min(n <= kMaxTileRows ? n : most, (n + wanted - 1) / wanted));
  const int64_t tiles = (n + tile - 1) / tile, items = tiles * kv_heads;
  // Later tiles reach more spans (causal). The pool hands each thread a contiguous run of
  // items, so the tiles are dealt round-robin: thread j's run holds tiles j, j + threads...
  std::vector<int64_t> order;
  order.reserve(tiles);
  for (int64_t j = 0; j < threads; ++j)
    for (int64_t t = j; t < tiles; t += threads) order.push_back(t);
  const int64_t work = n * (start + n) * kv_heads;
  const int64_t grain = work < 4096 ? items + 1 : 1;  // a small chunk: the calling thread alone
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    // Each thread keeps its scratch from call to call: fresh memory is pages to fault in.
    thread_local std::vector<float> kf, vf, qf, scores, stats, partial, o;
    const auto fit = [](std::vector<float>& v, int64_t size) {
      if (static_cast<int64_t>(v.size()) < size) v.resize(size);
    };
    const int64_t most_spans = (start + n + kSpan - 1) / kSpan;  // the last row's
    fit(kf, (kSpan + 16) * D);
    fit(vf, (kSpan + 16) * D);
    fit(qf, tile * G * D);
    fit(scores, tile * G * kSpan);
    fit(stats, most_spans * tile * 2 * G);  // per span: the tile's rows' max and sum
    fit(partial, most_spans * tile * G * D);
    fit(o, D);
    const auto fn = D == 64    ? prefill_span<T, 64>
                    : D == 128 ? prefill_span<T, 128>
                    : D == 256 ? prefill_span<T, 256>
                               : prefill_span<T, 0>;
#ifdef PARLEY_AMX_ATTENTION
    const bool amx = amx_attention<T>(D, G);
    if (amx) amx_attention_tiles();  // another library's tile code may have run here
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = order[item / kv_heads], h = item % kv_heads;
      const int64_t r0 = t * tile, r1 = std::min(n, r0 + tile);
      // Row r's spans: from the one its window starts in (0 without a window) to the one
      // that holds its position, as paged_decode's items for a decode there.
      const auto spans_of = [&](int64_t r) { return (start + r + 1 + kSpan - 1) / kSpan; };
      const auto first_span_of = [&](int64_t r) { return window_start(start + r, window) / kSpan; };
      const int64_t spans = spans_of(r1 - 1);
      for (int64_t s = first_span_of(r0); s < spans; ++s) {
#ifdef PARLEY_AMX_ATTENTION
        if (amx) {
          amx_prefill_span(q, k_cache, v_cache, table, block_size, kv_heads, H, h, start, r0,
                           r1, s * kSpan, G, scale, window, stats.data() + s * tile * 2 * G,
                           partial.data() + s * tile * G * D);
          continue;
        }
#endif
        fn(q, k_cache, v_cache, table, block_size, kv_heads, H, h, start, r0, r1, s * kSpan, G,
           D, scale, window, kf.data(), vf.data(), qf.data(), scores.data(),
           stats.data() + s * tile * 2 * G, partial.data() + s * tile * G * D);
      }
      // Combine each row's spans (combine_spans, as paged_decode does).
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row_first = first_span_of(r), row_spans = spans_of(r) - row_first;
        for (int64_t g = 0; g < G; ++g) {
          const auto piece = [&](int64_t i) {
            const int64_t s = row_first + i;
            const float* st = stats.data() + (s * tile + r - r0) * 2 * G;
            return SpanPiece{st[g], st[G + g],
                             partial.data() + ((s * tile + r - r0) * G + g) * D};
          };
          combine_spans(row_spans, D, piece, o.data(), out + (r * H + h * G + g) * D);
        }
      }
    }
#ifdef PARLEY_AMX_ATTENTION
    if (amx) _tile_release();
#endif
  });
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& table, int64_t start,
                         double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  check_attention(q, k_cache, v_cache, "tokens");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kLong,
              "table must be (blocks,) int64");
  TORCH_CHECK(start >= 0 && n >= 1 && start + n <= table.size(0) * block_size,
              "the chunk's positions exceed its block table");
  auto qc = q.contiguous();
  auto tc = table.contiguous();
  const int64_t* tp = tc.data_ptr<int64_t>();
  check_blocks(tp, start + n, block_size, k_cache.size(0));
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill", [&] {
    paged_prefill_impl(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                       v_cache.data_ptr<scalar_t>(), tp, out.data_ptr<scalar_t>(), n, start, H,
                       kv_heads, D, block_size, static_cast<float>(scale), window);
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// A decode step's layer stack in one call, for int4 weights: the same ops in the same order
// as the Python layer with FusedCpuOps (so the same bits), without ~15 Python calls a layer.
//
// weights: per layer qkv, o_proj, gate_up, down as (codes, d, m) for parley::q4_matmul
// (qmatmul.cpp), then the input and post norms' weights: 14 tensors a layer.

at::Tensor q4(const at::Tensor& x, const at::Tensor* w) {
  return parley_kernels::q4_matmul(x, w[0], w[1], w[2], x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& tables,
    const at::Tensor& lens, at::TensorList k_caches, at::TensorList v_caches,
    at::TensorList weights, int64_t heads, int64_t kv_heads, double eps, double scale) {
  constexpr int64_t kPerLayer = 14;
  const int64_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == static_cast<size_t>(layers) &&
                  weights.size() == static_cast<size_t>(kPerLayer * layers),
              "decode_layers: 2 caches and 14 weights a layer");
  const int64_t T = h0.size(0), D = cos.size(1);
  const int64_t q_size = heads * D;
  at::Tensor h = h0, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    at::Tensor x;
    if (l == 0) {
      x = rms_norm(h, w[12], eps);
      residual = h;
    } else {
      std::tie(x, residual) = add_rms_norm(h, residual, w[12], eps);
    }
    auto qkv = q4(x, w);
    auto qk = rope_store(qkv, cos, sin, positions, slots, k_caches[l], v_caches[l], heads,
                         kv_heads);
    auto o = paged_decode(qk.narrow(1, 0, heads), k_caches[l], v_caches[l], tables, lens, scale,
                          /*window=*/0);
    auto attn = q4(o.view({T, q_size}), w + 3);
    std::tie(x, residual) = add_rms_norm(attn, residual, w[13], eps);
    auto gate_up = q4(x, w + 6);
    auto halves = gate_up.chunk(2, -1);
    auto act = at::silu(halves[0]).mul_(halves[1]);
    h = q4(act, w + 9);
  }
  return {h, residual};
}

// The stack of a family with per-head q/k norms (Qwen3; Gemma 3 with its sandwich norms,
// GELU and local layers): the same ops in the same order as its Python layer
// (app/model/families) with FusedCpuOps, so the same bits.
//
// linears: per layer qkv, o_proj, gate_up, down as 3 tensors each, and 3 ints each in
// `kinds` saying which kernel: (0, 0, 0) for q4_matmul's (codes, d, m), else (group, bits,
// base) for group_matmul's (codes, scales, offsets; offsets empty: none). norms: per layer
// input, post, q, k, and with `sandwich` the attention's and the MLP's output norms.
// windows: per layer, 0 for global attention (rotary tables cos/sin), else local
// (local_cos/local_sin).

at::Tensor linear(const at::Tensor& x, const at::Tensor* w, const int64_t* kind) {
  if (kind[0] == 0) return parley_kernels::q4_matmul(x, w[0], w[1], w[2], x.scalar_type());
  const c10::optional<at::Tensor> off =
      w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
  return parley_kernels::group_matmul(x, w[0], w[1], off, kind[0], kind[1], kind[2],
                                      x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> decode_layers_normed(
    const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& local_cos, const at::Tensor& local_sin, const at::Tensor& positions,
    const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
    at::TensorList k_caches, at::TensorList v_caches, at::TensorList linears,
    at::IntArrayRef kinds, at::TensorList norms, at::IntArrayRef windows, int64_t heads,
    int64_t kv_heads, double eps, double scale, bool sandwich, bool gelu) {
  const int64_t layers = k_caches.size(), per_norms = sandwich ? 6 : 4;
  TORCH_CHECK(v_caches.size() == static_cast<size_t>(layers) &&
                  linears.size() == static_cast<size_t>(12 * layers) &&
                  kinds.size() == static_cast<size_t>(12 * layers) &&
                  norms.size() == static_cast<size_t>(per_norms * layers) &&
                  windows.size() == static_cast<size_t>(layers),
              "decode_layers_normed: per layer 2 caches, 4 linears of 3 tensors and 3 kinds, ",
              per_norms,
              " norms and a window");
  const int64_t T = h0.size(0), D = cos.size(1);
  const int64_t q_size = heads * D, kv_size = kv_heads * D;
  at::Tensor h = h0, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = linears.data() + 12 * l;
    const int64_t* kind = kinds.data() + 12 * l;
    const at::Tensor* nw = norms.data() + per_norms * l;
    at::Tensor x;
    if (l == 0) {
      x = rms_norm(h, nw[0], eps);
      residual = h;
    } else {
      std::tie(x, residual) = add_rms_norm(h, residual, nw[0], eps);
    }
    auto qkv = linear(x, w, kind);
    auto q = rms_norm(qkv.narrow(1, 0, q_size).reshape({-1, D}).contiguous(), nw[2], eps);
    auto k = rms_norm(qkv.narrow(1, q_size, kv_size).reshape({-1, D}).contiguous(), nw[3], eps);
    qkv = at::cat({q.view({T, -1}), k.view({T, -1}), qkv.narrow(1, q_size + kv_size, kv_size)},
                  -1);
    const bool local = windows[l] > 0;
    auto qk = rope_store(qkv, local ? local_cos : cos, local ? local_sin : sin, positions, slots,
                         k_caches[l], v_caches[l], heads, kv_heads);
    auto o = paged_decode(qk.narrow(1, 0, heads), k_caches[l], v_caches[l], tables, lens, scale,
                          windows[l]);
    auto attn = linear(o.reshape({T, q_size}), w + 3, kind + 3);
    if (sandwich) attn = rms_norm(attn, nw[4], eps);
    std::tie(x, residual) = add_rms_norm(attn, residual, nw[1], eps);
    auto halves = linear(x, w + 6, kind + 6).chunk(2, -1);
    auto act = gelu ? at::gelu(halves[0], "tanh").mul_(halves[1])
                    : at::silu(halves[0]).mul_(halves[1]);
    h = linear(act, w + 9, kind + 9);
    if (sandwich) h = rms_norm(h, nw[5], eps);
  }
  return {h, residual};
}

// Which arithmetic paged_decode and paged_prefill use for this dtype, head size and query
// heads a K/V head: for the start-up log.
std::string attention_path(at::ScalarType dtype, int64_t head_dim, int64_t groups) {
  const bool amx = dtype == at::kBFloat16 ? amx_attention<c10::BFloat16>(head_dim, groups)
                                          : amx_attention<float>(head_dim, groups);
  return amx ? "AMX (tdpbf16ps)" : "vector";
}

}  // namespace

TORCH_LIBRARY(parley, m) {
  m.def("attention_path(ScalarType dtype, int head_dim, int groups) -> str", &attention_path);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slots, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int heads, int kv_heads) -> Tensor");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
      "float scale, int window=0) -> Tensor");
  m.def(
      "paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int start, "
      "float scale, int window=0) -> Tensor");
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor positions, Tensor slots, "
      "Tensor tables, Tensor lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor[] weights, int heads, int kv_heads, float eps, float scale) "
      "-> (Tensor, Tensor)");
  m.def(
      "decode_layers_normed(Tensor h, Tensor cos, Tensor sin, Tensor local_cos, "
      "Tensor local_sin, Tensor positions, Tensor slots, Tensor tables, Tensor lens, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] linears, int[] kinds, "
      "Tensor[] norms, int[] windows, int heads, int kv_heads, float eps, float scale, "
      "bool sandwich, bool gelu) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(parley, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_normed", &decode_layers_normed);
}
