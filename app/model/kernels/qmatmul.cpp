// Parley's matmul over group-wise 4-bit weights (GGUF's Q4_0 / Q4_1 as stored, or floats
// rounded to 4 bits): y (M, N) = x (M, K) W^T with w[n, k] = d[n, b] * q[n, k] + m[n, b],
// q in 0..15, one (d, m) per group b of 32 along K. app/model/quant/int4.py packs the codes
// and calls it; it serves every linear of a decode step and of a prompt alike.
//
// One kernel for one row and for thousands, so a token's bits do not depend on whether it
// was decoded or came in a prompt, on its chunk, its batch or the thread count. Per output
// element, in this order, whatever M and whatever tile or thread computes it:
//
//   for each group b:  t = 0
//                      for each pair (2p, 2p+1) of its 16:  t += w[2p+1] x[2p+1]
//                                                           t += w[2p]   x[2p]
//                      acc = fma(d_b, t, acc);  acc = fma(m_b, xsum_b, acc)
//
// where x is bf16 (exact products) and xsum_b = the group's x summed in order in fp32.
// That pair order is AVX-512 BF16's vdpbf16ps (two exact products added in turn); the
// AVX2 and portable builds do the same adds as fp32 FMAs, so every build gives the same
// bits (denormal products aside, which vdpbf16ps flushes).
//
// Why not PyTorch's int4 kernel (which does compute a row on its own): it dequantizes 64
// weights per k with fp32 FMAs for every 4 rows, fine for decode but bound by that
// arithmetic for a prompt, and it rounds the scales and zeros to bf16. Here the codes
// become bf16 through a 16-entry table (one permute for 32 weights) and vdpbf16ps does 32
// multiply-adds an instruction; scales stay the file's fp16.
//
// Packed layout, per tile of 16 output rows (N padded to 16): K / 4 chunks of 32 bytes;
// byte 2n + j of chunk c holds q(n, 4c + j) in its low nibble and q(n, 4c + 2 + j) in its
// high one. Widened to 16-bit words, the low nibbles are vdpbf16ps's operand for the pair
// (4c, 4c + 1) (word 2n + j: row n, k = 4c + j) and the high nibbles for (4c + 2, 4c + 3).
// Scales: d and m as fp16, [tiles][K / 32][16].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;  // weights per (d, m)
constexpr int64_t kTile = 16;   // output rows a tile
constexpr int64_t kChunk = 32;  // bytes of codes per 4 k of a tile
constexpr int64_t kChunksPerGroup = kGroup / 4;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The group sums of x: xsum[b] = x[32b] + x[32b + 1] + ... in order, in fp32.
inline void group_sums(const uint16_t* x, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kGroup; ++b) {
    float s = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) s += bf16_to_float(x[b * kGroup + j]);
    out[b] = s;
  }
}

// ---------------------------------------------------------------------------------------
// The microkernels: rows [0, MR) of x (bf16, lda apart; their group sums xs, KB apart)
// against one tile; y gets 16 fp32 per row, ldy apart.

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr const char* kPath = "AVX-512 BF16 (vdpbf16ps)";
constexpr int kMR = 8;

inline __m512i code_table() {  // word i: bf16 of (i % 16)
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(static_cast<float>(i % 16)).x;
  return _mm512_load_si512(t);
}

template <int MR>
inline void tile_kernel(const uint8_t* codes, const c10::Half* d, const c10::Half* m,
                        const uint16_t* x, int64_t lda, const float* xs, int64_t KB,
                        float* y, int64_t ldy) {
  const __m512i table = code_table();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512 t[MR];
    for (int r = 0; r < MR; ++r) t[r] = _mm512_setzero_ps();
    const uint8_t* cb = codes + b * kChunksPerGroup * kChunk;
    for (int64_t c = 0; c < kChunksPerGroup; ++c) {
      const __m512i raw =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + c * kChunk)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(raw, low4), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), table);
      const int64_t k = b * kGroup + c * 4;
      for (int r = 0; r < MR; ++r) {
        int32_t p0, p1;  // x[k], x[k + 1] and x[k + 2], x[k + 3] as bf16 pairs
        std::memcpy(&p0, x + r * lda + k, 4);
        std::memcpy(&p1, x + r * lda + k + 2, 4);
        t[r] = _mm512_dpbf16_ps(t[r], w0, (__m512bh)_mm512_set1_epi32(p0));
        t[r] = _mm512_dpbf16_ps(t[r], w1, (__m512bh)_mm512_set1_epi32(p1));
      }
    }
    const __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kTile)));
    const __m512 mb = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * kTile)));
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm512_fmadd_ps(db, t[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xs[r * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

#else
#if defined(__AVX2__)
constexpr const char* kPath = "AVX2 (fp32 FMAs in vdpbf16ps's order)";
#else
constexpr const char* kPath = "portable C++ (fp32 FMAs in vdpbf16ps's order)";
#endif
constexpr int kMR = 4;

// The codes of a chunk as floats: q[h][j][n] = q(n, 4c + 2h + j).
inline void unpack_chunk(const uint8_t* chunk, float q[2][2][kTile]) {
  for (int n = 0; n < kTile; ++n)
    for (int j = 0; j < 2; ++j) {
      const uint8_t byte = chunk[2 * n + j];
      q[0][j][n] = static_cast<float>(byte & 0x0F);
      q[1][j][n] = static_cast<float>(byte >> 4);
    }
}

#if defined(__AVX2__)
struct V16 {
  __m256 lo, hi;
};
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v16_fma(V16 a, float b, V16 c) {
  const __m256 s = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, s, c.lo), _mm256_fmadd_ps(a.hi, s, c.hi)};
}
inline V16 v16_fmav(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void v16_store(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#else
struct V16 {
  float v[kTile];
};
inline V16 v16_zero() { return V16{}; }
inline V16 v16_load(const float* p) {
  V16 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline V16 v16_fma(V16 a, float b, V16 c) {
  for (int i = 0; i < kTile; ++i) c.v[i] = std::fma(a.v[i], b, c.v[i]);
  return c;
}
inline V16 v16_fmav(V16 a, V16 b, V16 c) {
  for (int i = 0; i < kTile; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline void v16_store(float* p, V16 v) { std::memcpy(p, v.v, sizeof v.v); }
#endif

template <int MR>
inline void tile_kernel(const uint8_t* codes, const c10::Half* d, const c10::Half* m,
                        const uint16_t* x, int64_t lda, const float* xs, int64_t KB,
                        float* y, int64_t ldy) {
  V16 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = v16_zero();
  alignas(64) float q[2][2][kTile];
  alignas(64) float db[kTile], mb[kTile];
  for (int64_t b = 0; b < KB; ++b) {
    V16 t[MR];
    for (int r = 0; r < MR; ++r) t[r] = v16_zero();
    for (int64_t c = 0; c < kChunksPerGroup; ++c) {
      unpack_chunk(codes + (b * kChunksPerGroup + c) * kChunk, q);
      const int64_t k = b * kGroup + c * 4;
      for (int h = 0; h < 2; ++h) {
        const V16 w0 = v16_load(q[h][0]), w1 = v16_load(q[h][1]);
        for (int r = 0; r < MR; ++r) {  // the pair's odd element first, as vdpbf16ps adds
          const uint16_t* xr = x + r * lda + k + 2 * h;
          t[r] = v16_fma(w1, bf16_to_float(xr[1]), t[r]);
          t[r] = v16_fma(w0, bf16_to_float(xr[0]), t[r]);
        }
      }
    }
    for (int i = 0; i < kTile; ++i) {
      db[i] = static_cast<float>(d[b * kTile + i]);
      mb[i] = static_cast<float>(m[b * kTile + i]);
    }
    const V16 dv = v16_load(db), mv = v16_load(mb);
    for (int r = 0; r < MR; ++r) {
      acc[r] = v16_fmav(dv, t[r], acc[r]);
      acc[r] = v16_fma(mv, xs[r * KB + b], acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) v16_store(y + r * ldy, acc[r]);
}
#endif

template <int MR>
void rows_tile(const uint8_t* codes, const c10::Half* d, const c10::Half* m, const uint16_t* x,
               int64_t K, const float* xs, float* out, int64_t N, int64_t n0) {
  const int64_t KB = K / kGroup;
  alignas(64) float y[MR * kTile];
  tile_kernel<MR>(codes, d, m, x, K, xs, KB, y, kTile);
  const int64_t cols = std::min<int64_t>(kTile, N - n0);
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * N + n0, y + r * kTile, cols * sizeof(float));
}

std::string q4_path() { return kPath; }

}  // namespace

namespace parley_kernels {

// x (M, K) fp32 or bf16 (rounded to bf16); codes, d, m as app/model/quant/int4.py's
// parley_layout packs an (N, K) weight, N = 16 x d's first dimension. y (M, N) in
// out_dtype (default: x's), from fp32 sums.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "q4_matmul: x must be (M, K)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "q4_matmul: K must be a multiple of ", kGroup);
  TORCH_CHECK(d.dim() == 3 && d.size(1) == K / kGroup && d.size(2) == kTile,
              "q4_matmul: scales must be (tiles, K / 32, 16)");
  const int64_t tiles = d.size(0), N = tiles * kTile, KB = K / kGroup;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * (K / 4) * kChunk,
              "q4_matmul: codes must be the packed uint8 layout for (N, K)");
  for (const auto* s : {&d, &m})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->is_contiguous() && s->sizes() == d.sizes(),
                "q4_matmul: scales must be fp16 (tiles, K / 32, 16)");
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // fp32 activations round here
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>());
    std::vector<float> xs(M * KB);
    for (int64_t r = 0; r < M; ++r) group_sums(xp + r * K, K, xs.data() + r * KB);
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const c10::Half* dp = d.data_ptr<c10::Half>();
    const c10::Half* mp = m.data_ptr<c10::Half>();
    float* yp = y.data_ptr<float>();
    const int64_t tile_bytes = (K / 4) * kChunk, tile_scales = KB * kTile;
    // A tile for all rows is an item; a few tiles an item for a small M, so that a
    // thread's share is worth waking it. The split never changes an element's bits.
    const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, M * KB));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* ct = cp + t * tile_bytes;
        const c10::Half* dt = dp + t * tile_scales;
        const c10::Half* mt = mp + t * tile_scales;
        int64_t r = 0;
        for (; r + kMR <= M; r += kMR)
          rows_tile<kMR>(ct, dt, mt, xp + r * K, K, xs.data() + r * KB, yp + r * N, N, t * kTile);
        for (; r < M; ++r)
          rows_tile<1>(ct, dt, mt, xp + r * K, K, xs.data() + r * KB, yp + r * N, N, t * kTile);
      }
    });
  }
  const auto want = out_dtype.value_or(x.scalar_type());
  return want == at::kFloat ? y : y.to(want);
}

}  // namespace parley_kernels

TORCH_LIBRARY_FRAGMENT(parley, m) {
  m.def("q4_matmul(Tensor x, Tensor codes, Tensor d, Tensor m, ScalarType? out_dtype) -> Tensor");
  m.def("q4_path() -> str", &q4_path);
}

TORCH_LIBRARY_IMPL(parley, CPU, m) { m.impl("q4_matmul", &parley_kernels::q4_matmul); }
