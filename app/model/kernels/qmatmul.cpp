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
// bits (denormal products aside, which vdpbf16ps flushes). Where the CPU has AMX (and the
// OS grants it), t is a tile unit's sum of the group instead, for every row alike: see
// "AMX" below.
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
//
// A prompt's many rows (from kUnpackRows) take the weights as bf16 words a thread unpacked
// for the call, a slab of tiles at a time, and each kernel call covers 8 rows x 2 tiles:
// 16 independent sums, each x pair broadcast once for both tiles. The same words meet the
// same x in the same order, so the bits are a decode's. 1,536 rows of the default model's
// 30 layers (bench: a script kept out of the repository, quiet machine, 2 threads): 779 ->
// 561-578 ms, against oneDNN's bf16 GEMM on bf16 weights 380-400 ms.

// group_matmul (GGUF's other group formats as stored: K-quants, Q5_0/Q5_1, Q8_0, a Q8_0 LM
// head) is the same kernel over other codes: w = scale * q + offset per group of 16 or 32,
// fp32 scales, q of 4, 5, 6 or 8 bits (app/model/quant/kquants.py's TiledGroupWeight lays
// them out). 4-bit codes are packed as above; wider ones take a byte each, a chunk's 64
// bytes being (4c, 4c + 1)'s 32 then (4c + 2, 4c + 3)'s, so that one permute of a 32- or
// 64-word table (or, for 8 bits, a conversion) gives the same operands. Per element it is
// the order above, group by group. It replaced an fp32 kernel with a lane per k (the
// codes converted and multiplied in fp32, four rows a tile): 2.4-3.7x its throughput at a
// prompt's rows, 2-4x at one row for Gemma 3's layers, on AVX-512 BF16. It never runs on
// AMX's tiles (a group of 16 is half a tile's K).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define PARLEY_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdlib>
#include <string>

namespace {

constexpr int64_t kGroup = 32;  // q4_matmul's weights per (d, m); group_matmul's: 16 or 32
constexpr int64_t kTile = 16;   // output rows a tile
// Bytes of codes per chunk (4 k of a tile's 16 rows): two 4-bit codes a byte, else one.
// 4 bits: two codes a byte; 5: two low nibbles a byte and a bit plane of the fifth bits;
// else a code a byte.
constexpr int64_t chunk_bytes(int bits) { return bits == 4 ? 32 : bits == 5 ? 40 : 64; }
constexpr int64_t kChunk = chunk_bytes(4);
constexpr int64_t kChunksPerGroup = kGroup / 4;

// Group b's codes (`group_bytes` a tile: 256 for q4_matmul) of the `count` tiles that start
// `ahead` tiles after `codes`: a decode reads a linear's codes once, a few tiles at a time,
// each tile a short stream (4.5 KiB for K = 576) that the hardware prefetcher learns too
// late, so a call asks for the next call's tiles as it goes (at one row: 18 -> ~24 GB/s
// from memory, 2 threads).
inline void prefetch_group(const uint8_t* codes, int64_t tile_bytes, int ahead, int count,
                           int64_t b, int64_t group_bytes = kChunksPerGroup * kChunk) {
  const uint8_t* p = codes + ahead * tile_bytes + b * group_bytes;
  for (int n = 0; n < count; ++n)
    for (int64_t c = 0; c < group_bytes; c += 64) __builtin_prefetch(p + n * tile_bytes + c);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The group sums of x, its M x K words taken as G = M x K / group groups of `group` (16 or
// 32) in a row: out[g] = x[group g] + x[group g + 1] + ... in order, in fp32. On AVX-512, 16
// groups' sums advance together, each lane gathering its group's next two words: one sum
// at a time waited on its 32 dependent adds, and a prompt's sums took a third of the
// matmul's time at 2 threads (0.7 ms of 2.1 for 1,536 rows of a 576 x 576 linear), before
// its threads started.
inline void group_sums(const uint16_t* x, int64_t G, float* out, int64_t group = kGroup) {
  int64_t g = 0;
#if defined(__AVX512F__)
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(group / 2)));  // a lane's first pair, in 32-bit units
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (; g + 16 <= G; g += 16) {
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x + g * group);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < group / 2; ++j) {
      const __m512i v = _mm512_i32gather_epi32(lanes, pairs + j, 4);
      s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));  // word 2j
      s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(v, high)));  // word 2j + 1
    }
    _mm512_storeu_ps(out + g, s);
  }
#endif
  for (; g < G; ++g) {
    float s = 0.f;
    for (int64_t j = 0; j < group; ++j) s += bf16_to_float(x[g * group + j]);
    out[g] = s;
  }
}

// A weight's codes as stored in a tile's chunks, by bits a code (B):
//   4: two a byte (byte 2n + j of a chunk c: q(n, 4c + j) in its low nibble, q(n, 4c + 2 + j)
//      in its high one), each standing for the integer code + base;
//   5: the same 32 bytes of low nibbles, then 8 bytes whose bit 32h + 2n + j (little-endian)
//      is q(n, 4c + 2h + j)'s fifth bit: 5 bits a weight, the file's own count;
//   6: one a byte, 0..63, standing for code + base (bytes 2n + j of the chunk's first 32:
//      q(n, 4c + j); of its second 32: q(n, 4c + 2 + j));
//   8: one a byte in the same order, an int8 that is the integer itself.
// However a code is stored, it becomes the same bf16 value (an integer of at most 8 bits is
// exact in bf16), so the format changes the bytes read, never the bits of a result.
inline float code_value(const uint8_t* chunk, int bits, int base, int n, int h, int j) {
  if (bits == 4 || bits == 5) {
    const uint8_t byte = chunk[2 * n + j];
    int q = h ? byte >> 4 : byte & 0x0F;
    if (bits == 5) {
      const int bit = 32 * h + 2 * n + j;
      q |= ((chunk[32 + bit / 8] >> (bit % 8)) & 1) << 4;
    }
    return static_cast<float>(q + base);
  }
  const uint8_t byte = chunk[32 * h + 2 * n + j];
  return bits == 8 ? static_cast<float>(static_cast<int8_t>(byte))
                   : static_cast<float>(byte + base);
}

// 16 scales (or offsets) as floats: the file's fp16, or fp32.
inline float scale_value(const c10::Half* p, int i) { return static_cast<float>(p[i]); }
inline float scale_value(const float* p, int i) { return p[i]; }

// ---------------------------------------------------------------------------------------
// The microkernels: rows [0, MR) of x (bf16, lda apart; their group sums xs, KB apart)
// against NT consecutive tiles (tile_bytes and tile_scales apart); y gets 16 NT fp32 a row,
// ldy apart. Several tiles at once for a few rows: each output's sums are a chain of
// dependent adds, which would otherwise wait on their latency (one row reading the codes
// takes one tile at a time all the same: row_chunk says why).

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr const char* kPath = "AVX-512 BF16 (vdpbf16ps)";
constexpr int kMR = 8;      // rows a kernel call at most
constexpr int kChains = 8;  // MR x NT: independent accumulators a call keeps, few rows
constexpr bool kUnpacks = true;  // many rows take the weights as bf16 words (Unpacked)
constexpr bool kOneTileARow = true;  // a decode's one row: one tile a call (row_chunk)

// Words i and 32 + i: bf16 of (i + base), i < 32: the look-up tables of codes that stand
// for code + base (a 4- or 5-bit code reads the first, a 6-bit one both).
inline void code_tables(int base, __m512i& lo, __m512i& hi) {
  alignas(64) uint16_t t[64];
  for (int i = 0; i < 64; ++i) t[i] = c10::BFloat16(static_cast<float>(i + base)).x;
  lo = _mm512_load_si512(t);
  hi = _mm512_load_si512(t + 32);
}

inline __m512bh pair_of(const uint16_t* p) {  // x[k], x[k + 1] in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// 16 scales as floats (loaded as they are laid out, 16 rows' apart from nothing).
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 sums to y as float, or rounded to bf16 (to nearest even, as c10::BFloat16 rounds).
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(c10::BFloat16* y, __m512 v) {
  alignas(64) float f[kTile];
  _mm512_store_ps(f, v);
  for (int i = 0; i < kTile; ++i) y[i] = c10::BFloat16(f[i]);
}

// 32 int8 codes as bf16 words: exact (|q| <= 128), two conversions of 16 then one pack.
inline __m512bh int8_words(const uint8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Where a kernel call gets a chunk's weights as vdpbf16ps operands (w0: the pairs
// (4c, 4c + 1) of the tile's 16 rows, w1: (4c + 2, 4c + 3)). Either source gives the same
// words, so the same bits.
template <int B>
struct Codes {  // from the stored codes (code_value's layouts): a table look-up (a permute)
  static constexpr int kBits = B;
  static constexpr int64_t kChunkBytes = chunk_bytes(B);
  const uint8_t* codes;
  int64_t tile_bytes;
  int base = 0;
  __m512i lo, hi, low4 = _mm512_set1_epi16(0x0F);
  Codes(const uint8_t* c, int64_t tb, int b = 0) : codes(c), tile_bytes(tb), base(b) {
    code_tables(b, lo, hi);
  }
  Codes at(int64_t tile) const {  // the same codes from `tile` on (tables copied, not made)
    Codes c = *this;
    c.codes += tile * tile_bytes;
    return c;
  }
  inline __m512bh word(__m512i raw) const {  // codes widened to 16 bits -> bf16 words
    if constexpr (B == 6) return (__m512bh)_mm512_permutex2var_epi16(lo, raw, hi);
    else return (__m512bh)_mm512_permutexvar_epi16(raw, lo);
  }
  inline void get(int n, int64_t chunk, __m512bh& w0, __m512bh& w1) const {
    const uint8_t* p = codes + n * tile_bytes + chunk * kChunkBytes;
    if constexpr (B == 4 || B == 5) {
      const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      __m512i q0 = _mm512_and_si512(raw, low4), q1 = _mm512_srli_epi16(raw, 4);
      if constexpr (B == 5) {  // the fifth bits: 16 in the words whose bit is set
        uint32_t m0, m1;
        std::memcpy(&m0, p + 32, 4);
        std::memcpy(&m1, p + 36, 4);
        q0 = _mm512_or_si512(q0, _mm512_maskz_set1_epi16(m0, 16));
        q1 = _mm512_or_si512(q1, _mm512_maskz_set1_epi16(m1, 16));
      }
      w0 = word(q0);
      w1 = word(q1);
    } else if constexpr (B == 8) {
      w0 = int8_words(p);
      w1 = int8_words(p + 32);
    } else {
      w0 = word(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
      w1 = word(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))));
    }
  }
};

struct Unpacked {  // from words unpacked once for many rows (unpack_tiles): two loads
  const uint16_t* words;
  int64_t tile_words;
  inline void get(int n, int64_t chunk, __m512bh& w0, __m512bh& w1) const {
    const uint16_t* p = words + n * tile_words + chunk * 64;
    w0 = (__m512bh)_mm512_loadu_si512(p);
    w1 = (__m512bh)_mm512_loadu_si512(p + 32);
  }
};

template <typename W>
constexpr bool kIsCodes = !std::is_same_v<W, Unpacked>;

// Tiles a call for kMR rows: with unpacked words 2 (16 independent sums: vdpbf16ps takes
// several cycles, and the 8 of one tile left the units waiting on their latency; 3 tiles'
// 24 sums and 24 accumulators spilled more: on AMD EPYC Zen 4, 1,589 rows of the default
// model's linears 166-170 -> 176-178 GMAC/s, 4,600 rows 0.85x the time, 48 and 256 rows
// no slower); with the codes 1 (the unpacking takes the other registers).
template <typename W>
constexpr int kWideNT = kIsCodes<W> ? 1 : 2;

// Tiles' codes as Unpacked words: per chunk, w0's 32 words then w1's.
template <int B>
inline void unpack_tiles(const Codes<B>& src, int64_t tiles, uint16_t* out) {
  const int64_t chunks = src.tile_bytes / Codes<B>::kChunkBytes;
  for (int64_t n = 0; n < tiles; ++n)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512bh w0, w1;
      src.get(static_cast<int>(n), c, w0, w1);
      uint16_t* p = out + (n * chunks + c) * 64;
      _mm512_storeu_si512(p, (__m512i)w0);
      _mm512_storeu_si512(p + 32, (__m512i)w1);
    }
}

// Per group b of G weights: t = the pairs' chain (4 k a chunk); acc = fma(d_b, t, acc);
// with offsets, acc = fma(m_b, xsum_b, acc). S: the scales' type.
template <int MR, int NT, typename W, typename S, typename Out>
inline void tile_kernel(const W& w, const S* d, const S* m, int64_t tile_scales, int64_t G,
                        const uint16_t* x, int64_t lda, const float* xs, int64_t KB, Out* y,
                        int64_t ldy) {
  const int64_t chunks = G / 4;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NT; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    if constexpr (kIsCodes<W>)
      prefetch_group(w.codes, w.tile_bytes, NT, NT, b, chunks * W::kChunkBytes);
    __m512 t[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NT; ++n) t[r][n] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = b * G + c * 4;
      __m512bh w0[NT], w1[NT];
      for (int n = 0; n < NT; ++n) w.get(n, b * chunks + c, w0[n], w1[n]);
      for (int r = 0; r < MR; ++r) {  // each x pair read once for the NT tiles
        const __m512bh p0 = pair_of(x + r * lda + k), p1 = pair_of(x + r * lda + k + 2);
        for (int n = 0; n < NT; ++n) {
          t[r][n] = _mm512_dpbf16_ps(t[r][n], w0[n], p0);
          t[r][n] = _mm512_dpbf16_ps(t[r][n], w1[n], p1);
        }
      }
    }
    for (int n = 0; n < NT; ++n) {
      const __m512 db = load16(d + n * tile_scales + b * kTile);
      for (int r = 0; r < MR; ++r) acc[r][n] = _mm512_fmadd_ps(db, t[r][n], acc[r][n]);
      if (m != nullptr) {
        const __m512 mb = load16(m + n * tile_scales + b * kTile);
        for (int r = 0; r < MR; ++r)
          acc[r][n] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xs[r * KB + b]), acc[r][n]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NT; ++n) store16(y + r * ldy + n * kTile, acc[r][n]);
}

// One row against one tile from the codes (a decode): tile_kernel<1, 1>'s arithmetic, in
// its order for every element, with kInFlight groups' chains interleaved. A group's chain
// is 16 dependent vdpbf16ps (its 8 chunks, two pairs each), and one chain at a time left
// the core waiting on their latency: the groups are independent until each one's sum is
// scaled into acc, which still happens group by group, so the bits are tile_kernel's. The
// default model's 120 linears at one row on an Intel Xeon (AVX-512 BF16, 2 threads): 4.91
// -> 4.51 ms; two, four or six groups in flight measured as three.
template <int kInFlight, typename W, typename S, typename Out>
inline void row_tile(const W& w, const S* d, const S* m, int64_t G, const uint16_t* x,
                     const float* xs, int64_t KB, Out* y) {
  const int64_t chunks = G / 4, group_bytes = chunks * W::kChunkBytes;
  __m512 acc = _mm512_setzero_ps();
  auto scale = [&](int64_t b, __m512 t) {
    acc = _mm512_fmadd_ps(load16(d + b * kTile), t, acc);
    if (m != nullptr) acc = _mm512_fmadd_ps(load16(m + b * kTile), _mm512_set1_ps(xs[b]), acc);
  };
  auto groups = [&](int64_t b, auto n) {  // groups [b, b + n), n a compile-time count
    constexpr int kN = decltype(n)::value;
    for (int g = 0; g < kN; ++g) prefetch_group(w.codes, w.tile_bytes, 1, 1, b + g, group_bytes);
    __m512 t[kN];
    for (int g = 0; g < kN; ++g) t[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c)
      for (int g = 0; g < kN; ++g) {
        const int64_t k = (b + g) * G + c * 4;
        __m512bh w0, w1;
        w.get(0, (b + g) * chunks + c, w0, w1);
        t[g] = _mm512_dpbf16_ps(t[g], w0, pair_of(x + k));
        t[g] = _mm512_dpbf16_ps(t[g], w1, pair_of(x + k + 2));
      }
    for (int g = 0; g < kN; ++g) scale(b + g, t[g]);
  };
  int64_t b = 0;
  for (; b + kInFlight <= KB; b += kInFlight) groups(b, std::integral_constant<int, kInFlight>{});
  for (; b < KB; ++b) groups(b, std::integral_constant<int, 1>{});
  store16(y, acc);
}

#else
#if defined(__AVX2__)
constexpr const char* kPath = "AVX2 (fp32 FMAs in vdpbf16ps's order)";
#else
constexpr const char* kPath = "portable C++ (fp32 FMAs in vdpbf16ps's order)";
#endif
constexpr int kMR = 4;
constexpr int kChains = 4;
constexpr bool kUnpacks = false;  // these builds always read the codes (not measured otherwise)
constexpr bool kOneTileARow = false;  // not measured on these builds

template <int B>
struct Codes {
  static constexpr int kBits = B;
  static constexpr int64_t kChunkBytes = chunk_bytes(B);
  const uint8_t* codes;
  int64_t tile_bytes;
  int base = 0;
  Codes(const uint8_t* c, int64_t tb, int b = 0) : codes(c), tile_bytes(tb), base(b) {}
  Codes at(int64_t tile) const { return Codes(codes + tile * tile_bytes, tile_bytes, base); }
};
struct Unpacked {  // never made here (kUnpacks): run() names it in a discarded branch
  const uint16_t* words;
  int64_t tile_words;
};
template <typename W>
constexpr bool kIsCodes = !std::is_same_v<W, Unpacked>;
template <typename W>
constexpr int kWideNT = 1;
template <int B>
inline void unpack_tiles(const Codes<B>&, int64_t, uint16_t*) {}

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
inline void v16_store(c10::BFloat16* p, V16 v) {
  alignas(32) float f[kTile];
  v16_store(f, v);
  for (int i = 0; i < kTile; ++i) p[i] = c10::BFloat16(f[i]);
}

// A chunk's codes (at p, code_value's layouts) as floats: q[h][j] holds the tile's 16 rows
// at k = 4c + 2h + j. Each 128-bit half of a 32-byte run holds 8 rows' (j = 0, 1) pairs:
// one byte shuffle puts each half's j = 0 bytes before its j = 1 bytes.
template <int B>
inline void chunk_vecs(const uint8_t* p, int base, V16 q[2][2]) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i offset = _mm256_set1_epi32(base), low4 = _mm256_set1_epi8(0x0F);
  const auto eight = [&](__m128i v) {  // the low 8 bytes as 8 floats
    const __m256i i = B == 8 ? _mm256_cvtepi8_epi32(v)
                             : _mm256_add_epi32(_mm256_cvtepu8_epi32(v), offset);
    return _mm256_cvtepi32_ps(i);
  };
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  for (int h = 0; h < 2; ++h) {
    __m256i raw;
    if constexpr (B == 4 || B == 5) {
      raw = _mm256_and_si256(h ? _mm256_srli_epi16(packed, 4) : packed, low4);
      if constexpr (B == 5) {  // byte i gets 16 where bit i of the half's 32 is set
        uint32_t m;
        std::memcpy(&m, p + 32 + 4 * h, 4);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(static_cast<int32_t>(m)),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                             2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        raw = _mm256_or_si256(raw, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
    } else {
      raw = h ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)) : packed;
    }
    const __m256i s = _mm256_shuffle_epi8(raw, split);
    const __m128i rows0 = _mm256_castsi256_si128(s), rows8 = _mm256_extracti128_si256(s, 1);
    q[h][0] = {eight(rows0), eight(rows8)};
    q[h][1] = {eight(_mm_srli_si128(rows0, 8)), eight(_mm_srli_si128(rows8, 8))};
  }
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
inline void v16_store(c10::BFloat16* p, V16 v) {
  for (int i = 0; i < kTile; ++i) p[i] = c10::BFloat16(v.v[i]);
}

template <int B>
inline void chunk_vecs(const uint8_t* p, int base, V16 q[2][2]) {
  for (int n = 0; n < kTile; ++n)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) q[h][j].v[n] = code_value(p, B, base, n, h, j);
}
#endif

template <int MR, int NT, typename W, typename S, typename Out>
inline void tile_kernel(const W& w, const S* d, const S* m, int64_t tile_scales, int64_t G,
                        const uint16_t* x, int64_t lda, const float* xs, int64_t KB, Out* y,
                        int64_t ldy) {
  static_assert(kIsCodes<W>, "the portable kernel reads the codes");
  const int64_t chunks = G / 4;
  V16 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NT; ++n) acc[r][n] = v16_zero();
  V16 q[2][2];
  alignas(64) float db[kTile], mb[kTile];
  for (int64_t b = 0; b < KB; ++b) {
    V16 t[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NT; ++n) t[r][n] = v16_zero();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = b * G + c * 4;
      for (int n = 0; n < NT; ++n) {
        chunk_vecs<W::kBits>(w.codes + n * w.tile_bytes + (b * chunks + c) * W::kChunkBytes,
                             w.base, q);
        for (int h = 0; h < 2; ++h) {
          const V16 w0 = q[h][0], w1 = q[h][1];
          for (int r = 0; r < MR; ++r) {  // the pair's odd element first, as vdpbf16ps adds
            const uint16_t* xr = x + r * lda + k + 2 * h;
            t[r][n] = v16_fma(w1, bf16_to_float(xr[1]), t[r][n]);
            t[r][n] = v16_fma(w0, bf16_to_float(xr[0]), t[r][n]);
          }
        }
      }
    }
    for (int n = 0; n < NT; ++n) {
      for (int i = 0; i < kTile; ++i) db[i] = scale_value(d + n * tile_scales + b * kTile, i);
      const V16 dv = v16_load(db);
      for (int r = 0; r < MR; ++r) acc[r][n] = v16_fmav(dv, t[r][n], acc[r][n]);
      if (m != nullptr) {
        for (int i = 0; i < kTile; ++i) mb[i] = scale_value(m + n * tile_scales + b * kTile, i);
        const V16 mv = v16_load(mb);
        for (int r = 0; r < MR; ++r) acc[r][n] = v16_fma(mv, xs[r * KB + b], acc[r][n]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NT; ++n) v16_store(y + r * ldy + n * kTile, acc[r][n]);
}
#endif

// The operands of one call, and the tiles and rows it covers: codes (tile_bytes a tile),
// scales and offsets (m: none where null) of type S, tile_scales a tile, KB groups of G a
// row; x (bf16) and its group sums xs (with offsets), y (M, N).
template <typename S, typename Out>
struct Operands {
  const uint8_t* codes;
  const S *d, *m;
  const uint16_t* x;
  const float* xs;
  Out* y;
  int64_t K, KB, N, tile_bytes, tile_scales, G = kGroup;
};

template <int B>
inline Codes<B> tiles_from(const Codes<B>& w, int64_t tile) {
  return w.at(tile);
}
inline Unpacked tiles_from(const Unpacked& w, int64_t tile) {
  return {w.words + tile * w.tile_words, w.tile_words};
}

// Rows [r, r + MR) against tiles [t, t + NT); w's first tile is tile `base`.
template <int MR, int NT, typename W, typename S, typename Out>
inline void call(const Operands<S, Out>& o, const W& w, int64_t base, int64_t r, int64_t t) {
  if constexpr (MR == 1 && NT == 1 && kIsCodes<W> && kOneTileARow) {
    row_tile<3>(tiles_from(w, t - base), o.d + t * o.tile_scales,
                o.m ? o.m + t * o.tile_scales : nullptr, o.G, o.x + r * o.K, o.xs + r * o.KB,
                o.KB, o.y + r * o.N + t * kTile);
    return;
  }
  tile_kernel<MR, NT>(tiles_from(w, t - base), o.d + t * o.tile_scales,
                      o.m ? o.m + t * o.tile_scales : nullptr, o.tile_scales, o.G,
                      o.x + r * o.K, o.K, o.xs + r * o.KB, o.KB, o.y + r * o.N + t * kTile, o.N);
}

// Rows [r, r + MR) against tiles [begin, end): NT tiles at a time, fewer at the end.
template <int MR, typename W, typename S, typename Out>
void row_chunk(const Operands<S, Out>& o, const W& w, int64_t base, int64_t r, int64_t begin,
               int64_t end) {
  // One row reading the codes (a decode) takes one tile a call: its codes are then read as
  // one stream in order, each call prefetching the next tile's group, where eight tiles a
  // call read eight interleaved streams. The default model's decode step 5.6-6.1 -> 4.6-4.8
  // ms on AVX-512 BF16, the same bits (the split never changes an element's sums); with two
  // to four rows several tiles a call stay faster (four rows: 6.2 -> 6.9 ms with one).
  constexpr int NT = MR == 1 && kIsCodes<W> && kOneTileARow ? 1
                     : MR == kMR                           ? kWideNT<W>
                                                           : std::max(1, kChains / MR);
  int64_t t = begin;
  for (; t + NT <= end; t += NT) call<MR, NT>(o, w, base, r, t);
  for (; t < end; ++t) call<MR, 1>(o, w, base, r, t);
}

// Rows [r0, r1) against tiles [begin, end), in chunks of kMR rows, then 4, 2, 1.
template <typename W, typename S, typename Out>
void rows_against(const Operands<S, Out>& o, const W& w, int64_t base, int64_t r0, int64_t r1,
                  int64_t begin, int64_t end) {
  int64_t r = r0;
  for (; r + kMR <= r1; r += kMR) row_chunk<kMR>(o, w, base, r, begin, end);
  if constexpr (kMR > 4)
    for (; r + 4 <= r1; r += 4) row_chunk<4>(o, w, base, r, begin, end);
  for (; r + 2 <= r1; r += 2) row_chunk<2>(o, w, base, r, begin, end);
  for (; r < r1; ++r) row_chunk<1>(o, w, base, r, begin, end);
}

// From this many rows a thread unpacks a slab of its tiles to bf16 words once and passes
// every row over them (~256 KiB of words: the slab stays in L2); fewer rows read the codes.
constexpr int64_t kUnpackRows = 32, kUnpackBytes = 256 << 10;

// y = x W^T over codes of B bits a code (code_value's layouts), `base` their integer offset.
template <int B, typename S, typename Out>
void run(const Operands<S, Out>& o, int64_t M, int64_t tiles, int base = 0) {
  // Threads split the tiles (a few an item for a small M, so that a thread's share is
  // worth waking it: at one row, 256 blocks of 32 weights, so that each of a decode's
  // linears, even the 576 x 576 one, is split across two threads); each takes rows in
  // blocks of kRowBlock against a slab of its tiles, so that the slab's codes (or words)
  // stay in cache while the block's rows pass over them. The split never changes an
  // element's bits.
  constexpr int64_t kRowBlock = 64, kSlab = 16;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, M * (o.K / kGroup)));
  const Codes<B> w_codes(o.codes, o.tile_bytes, base);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    if constexpr (kUnpacks) {
      if (M >= kUnpackRows) {
        const int64_t tile_words = o.K * kTile;
        const int64_t fit = kUnpackBytes / (tile_words * 2);
        constexpr int64_t nt = kWideNT<Unpacked>;
        const int64_t slab = std::max<int64_t>(nt, fit / nt * nt);
        thread_local std::vector<uint16_t> words;
        if (words.size() < static_cast<size_t>(slab * tile_words)) words.resize(slab * tile_words);
        for (int64_t s = begin; s < end; s += slab) {
          const int64_t e = std::min(end, s + slab);
          unpack_tiles(w_codes.at(s), e - s, words.data());
          const Unpacked w{words.data(), tile_words};
          for (int64_t r = 0; r < M; r += kRowBlock)
            rows_against(o, w, s, r, std::min(M, r + kRowBlock), s, e);
        }
        return;
      }
    }
    for (int64_t s = begin; s < end; s += kSlab)
      for (int64_t r = 0; r < M; r += kRowBlock)
        rows_against(o, w_codes, 0, r, std::min(M, r + kRowBlock), s, std::min(end, s + kSlab));
  });
}

// ---------------------------------------------------------------------------------------
// AMX (Intel's tile units, from Sapphire Rapids): where the compiler targets them and the OS
// has granted this process the tile state, every row (a decode's one and a prompt's
// thousands) takes each group's sum t from one tdpbf16ps into a zeroed tile instead of the
// chain of vdpbf16ps above, and the rest as above: acc = fma(d_b, t, acc); acc =
// fma(m_b, xsum_b, acc). A tile unit rounds a group's 32 products its own way (measured on
// this path's first machine: ~6% of sums differ from vdpbf16ps's pair-by-pair rounding, and
// from any order of fp32 adds), so a machine with AMX has AMX's bits, the same for any M, any
// chunk, batch or thread; a machine without it, vdpbf16ps's. Which one a process runs is
// logged at start (q4_path) and can be turned off (PARLEY_AMX=0, or parley::q4_amx(false)).
//
// A CPU can report AMX in CPUID while its OS has not enabled the tile state (XCR0), and a
// tile instruction then dies of SIGILL: the path runs only once arch_prctl has granted the
// tile data and XCR0 shows it enabled; otherwise the process keeps vdpbf16ps.
//
// Per group and row block (16 rows) the A tile is x's 32 words a row, and a B tile is one
// output tile's 16 x 32 weights as 16 rows of 16 word pairs: exactly the Unpacked words of
// that group (8 chunks of 64 words), so a prompt's unpacked slab is read in place and a
// decode unpacks each group's codes into 1 KiB first. Two row blocks x two output tiles a
// step (four C tiles, each A and B tile used twice); the sums leave their tiles through
// memory for the scale and zero-point FMAs.

bool amx_granted() {
#ifdef PARLEY_AMX
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    uint32_t lo, hi;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
    constexpr uint64_t kTileState = (1ull << 17) | (1ull << 18);  // XTILECFG, XTILEDATA
    return (xcr0 & kTileState) == kTileState;
  }();
  return granted;
#else
  return false;
#endif
}

std::atomic<bool> amx_wanted{[] {
  const char* v = std::getenv("PARLEY_AMX");
  return v == nullptr || std::string(v) != "0";
}()};

inline bool amx_on() { return amx_wanted.load(std::memory_order_relaxed) && amx_granted(); }

#ifdef PARLEY_AMX
inline __m512 halves(const c10::Half* p) {  // 16 fp16 scales as floats
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums (row block i, output tile j at 2i + j); 4-5: x of row blocks 0, 1; 6-7:
// weights of output tiles 0, 1. `rows`: rows of x in the second block (the first has 16, or
// `rows` when it is alone).
inline void configure(int first, int second) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  const int block[2] = {first, second};
  for (int i = 0; i < 2; ++i) {
    const int r = std::max(1, block[i]);
    c.rows[2 * i] = c.rows[2 * i + 1] = c.rows[4 + i] = static_cast<uint8_t>(r);
  }
  c.rows[6] = c.rows[7] = 16;
  _tile_loadconfig(&c);
}

// One output tile's weights for group b as a B tile (1 KiB, 64 bytes a row): a slab's
// unpacked words, read in place.
struct AmxFromWords {
  Unpacked src;
  const uint16_t* get(int, int64_t tile, int64_t b) const {
    return src.words + tile * src.tile_words + b * kGroup * kTile;
  }
};

// Rows [r, r + rows) (rows <= 32: blocks of 16, the configuration's) against output tiles
// [t, t + NT), NT 1 or 2; w's tile 0 is tile `base`.
template <int NT, typename W, typename Out>
void amx_block(const Operands<c10::Half, Out>& o, W& w, int64_t base, int64_t r, int rows, int64_t t) {
  const int RB = rows > 16 ? 2 : 1;
  const int r0 = std::min(rows, 16), r1 = rows - r0;
  alignas(64) float acc[2][NT][kTile][kTile];
  alignas(64) float sums[2][NT][kTile][kTile];
  std::memset(acc, 0, sizeof acc);
  const int64_t lda = o.K * 2;  // bytes
  const uint16_t* x0 = o.x + r * o.K;
  const uint16_t* x1 = x0 + 16 * o.K;
  for (int64_t b = 0; b < o.KB; ++b) {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    _tile_loadd(4, x0 + b * kGroup, lda);
    if (RB == 2) {
      _tile_zero(2);
      if constexpr (NT == 2) _tile_zero(3);
      _tile_loadd(5, x1 + b * kGroup, lda);
    }
    _tile_loadd(6, w.get(0, t - base, b), 64);
    _tile_dpbf16ps(0, 4, 6);
    if (RB == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, w.get(1, t + 1 - base, b), 64);
      _tile_dpbf16ps(1, 4, 7);
      if (RB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums[0][0], 64);
    if constexpr (NT == 2) _tile_stored(1, sums[0][1], 64);
    if (RB == 2) {
      _tile_stored(2, sums[1][0], 64);
      if constexpr (NT == 2) _tile_stored(3, sums[1][1], 64);
    }
    for (int n = 0; n < NT; ++n) {
      const int64_t s = (t + n) * o.tile_scales + b * kTile;
      const __m512 db = halves(o.d + s);
      const __m512 mb = halves(o.m + s);
      for (int i = 0; i < RB; ++i) {
        const int n_rows = i == 0 ? r0 : r1;
        const float* xs = o.xs + (r + 16 * i) * o.KB + b;
        for (int q = 0; q < n_rows; ++q) {
          __m512 a = _mm512_load_ps(acc[i][n][q]);
          a = _mm512_fmadd_ps(db, _mm512_load_ps(sums[i][n][q]), a);
          a = _mm512_fmadd_ps(mb, _mm512_set1_ps(xs[q * o.KB]), a);
          _mm512_store_ps(acc[i][n][q], a);
        }
      }
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int q = 0; q < (i == 0 ? r0 : r1); ++q)
      for (int n = 0; n < NT; ++n)
        store16(o.y + (r + 16 * i + q) * o.N + (t + n) * kTile,
                _mm512_load_ps(acc[i][n][q]));
}

// Rows [0, M) against tiles [begin, end), w's tile 0 being `base`: blocks of 32 rows (the
// last one shorter), tiles two at a time.
template <typename W, typename Out>
void amx_rows(const Operands<c10::Half, Out>& o, W& w, int64_t base, int64_t M, int64_t begin,
              int64_t end, int& configured) {
  for (int64_t r = 0; r < M; r += 32) {
    const int rows = static_cast<int>(std::min<int64_t>(32, M - r));
    const int key = rows;
    if (configured != key) {
      configure(std::min(rows, 16), rows - std::min(rows, 16));
      configured = key;
    }
    int64_t t = begin;
    for (; t + 2 <= end; t += 2) amx_block<2>(o, w, base, r, rows, t);
    if (t < end) amx_block<1>(o, w, base, r, rows, t);
  }
}


// A few rows (a decode, a small batch): one row block against three output tiles a step,
// each with its own B tile (5-7) and sum tile (0-2), so that no tile waits on another's
// store; a group's weights are unpacked one group ahead, into the other half of a double
// buffer, while the tile unit works on this one, and a group's sums are scaled one group
// late, once their tiles have been stored.
inline void configure_small(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  for (int t : {0, 1, 2, 4}) c.rows[t] = static_cast<uint8_t>(rows);
  c.rows[3] = 1;
  for (int t : {5, 6, 7}) c.rows[t] = 16;
  _tile_loadconfig(&c);
}

template <int NT, int kRows, typename Out>  // kRows: the rows when fixed (a decode's 1), else 0
void amx_small(const Operands<c10::Half, Out>& o, const Codes<4>& codes, int64_t r, int any_rows, int64_t t) {
  const int rows = kRows ? kRows : any_rows;
  alignas(64) uint16_t words[2][3][kGroup * kTile];
  alignas(64) float sums[2][3][kTile][kTile];
  __m512 acc[16][3];
  for (int q = 0; q < rows; ++q)
    for (int n = 0; n < NT; ++n) acc[q][n] = _mm512_setzero_ps();
  const int64_t lda = o.K * 2;
  const uint16_t* x = o.x + r * o.K;
  // Each tile's codes made once a call: a Codes is three look-up vectors and a pointer,
  // and copied for every group and tile (codes.at inside unpack) it cost an Intel Xeon's
  // decode ~35% of these calls (the default model's four linears at one row, 2 threads:
  // 196 -> 126 us a layer, level with the vector path's 124).
  const Codes<4> tile_codes[3] = {codes.at(t), codes.at(t + (NT > 1)), codes.at(t + 2 * (NT > 2))};
  auto unpack = [&](int64_t b) {
    for (int n = 0; n < NT; ++n) {
      const Codes<4>& at = tile_codes[n];
      uint16_t* p = words[b & 1][n];
      for (int64_t c = 0; c < kChunksPerGroup; ++c) {
        __m512bh w0, w1;
        at.get(0, b * kChunksPerGroup + c, w0, w1);
        _mm512_store_si512(p + c * 64, (__m512i)w0);
        _mm512_store_si512(p + c * 64 + 32, (__m512i)w1);
      }
    }
  };
  auto scale = [&](int64_t b) {
    for (int n = 0; n < NT; ++n) {
      const int64_t s = (t + n) * o.tile_scales + b * kTile;
      const __m512 db = halves(o.d + s);
      const __m512 mb = halves(o.m + s);
      for (int q = 0; q < rows; ++q) {
        acc[q][n] = _mm512_fmadd_ps(db, _mm512_load_ps(sums[b & 1][n][q]), acc[q][n]);
        acc[q][n] = _mm512_fmadd_ps(mb, _mm512_set1_ps(o.xs[(r + q) * o.KB + b]), acc[q][n]);
      }
    }
  };
  unpack(0);
  for (int64_t b = 0; b < o.KB; ++b) {
    prefetch_group(codes.codes + t * codes.tile_bytes, codes.tile_bytes, NT, NT, b);
    _tile_loadd(4, x + b * kGroup, lda);
    _tile_zero(0);
    _tile_loadd(5, words[b & 1][0], 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_zero(1);
      _tile_loadd(6, words[b & 1][1], 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_zero(2);
      _tile_loadd(7, words[b & 1][2], 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (b + 1 < o.KB) unpack(b + 1);
    if (b > 0) scale(b - 1);
    _tile_stored(0, sums[b & 1][0], 64);
    if constexpr (NT > 1) _tile_stored(1, sums[b & 1][1], 64);
    if constexpr (NT > 2) _tile_stored(2, sums[b & 1][2], 64);
  }
  scale(o.KB - 1);
  for (int q = 0; q < rows; ++q)
    for (int n = 0; n < NT; ++n) store16(o.y + (r + q) * o.N + (t + n) * kTile, acc[q][n]);
}

template <typename Out>
void run_amx(const Operands<c10::Half, Out>& o, int64_t M, int64_t tiles) {
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, M * o.KB));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    int configured = -1;  // another library's tile code may have run on this thread since
    if (M >= kUnpackRows) {
      const int64_t tile_words = o.K * kTile;
      const int64_t fit = kUnpackBytes / (tile_words * 2);
      const int64_t slab = std::max<int64_t>(2, fit / 2 * 2);
      thread_local std::vector<uint16_t> words;
      if (words.size() < static_cast<size_t>(slab * tile_words)) words.resize(slab * tile_words);
      for (int64_t s = begin; s < end; s += slab) {
        const int64_t e = std::min(end, s + slab);
        unpack_tiles(Codes<4>(o.codes, o.tile_bytes).at(s), e - s, words.data());
        AmxFromWords w{Unpacked{words.data(), tile_words}};
        amx_rows(o, w, s, M, s, e, configured);
      }
    } else {
      const Codes<4> codes(o.codes, o.tile_bytes);
      for (int64_t r = 0; r < M; r += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, M - r));
        configure_small(rows);
        int64_t t = begin;
        if (rows == 1) {  // its sums kept in registers
          for (; t + 3 <= end; t += 3) amx_small<3, 1>(o, codes, r, rows, t);
          if (end - t == 2) amx_small<2, 1>(o, codes, r, rows, t);
          if (end - t == 1) amx_small<1, 1>(o, codes, r, rows, t);
          continue;
        }
        for (; t + 3 <= end; t += 3) amx_small<3, 0>(o, codes, r, rows, t);
        if (end - t == 2) amx_small<2, 0>(o, codes, r, rows, t);
        if (end - t == 1) amx_small<1, 0>(o, codes, r, rows, t);
      }
    }
    _tile_release();
  });
}
#endif

// ---------------------------------------------------------------------------------------
// q8_matmul: a Q8_0 weight (group_matmul's 8-bit tiles: groups of 32, fp16 scales, no
// offsets) against x quantized the way llama.cpp quantizes a Q8_0 dot product's
// activations: per row and group b of 32, s_b = max|x| / 127 and q = x / s_b rounded to the
// nearest integer (half to even). Per output element, group by group in order:
//
//   t = sum over the group of q_w q_x        (integers: exact, in any order)
//   acc = fma(d_b, float(t) * s_b, acc)
//
// The integer sums are exact however they are split, so the bits depend on the row alone,
// for any M, thread count or build: the AVX-512 VNNI path (vpdpbusd, 64 multiply-adds an
// instruction, the codes made unsigned by adding 128 and the sum corrected by 128 times
// the group's sum of q_x) and the portable loop give the same. Against group_matmul's bf16
// x (32 multiply-adds a vdpbf16ps, after the codes are converted to bf16): x keeps 8 bits
// of its group's largest value instead of 8 significant bits of its own, which is what
// llama-server's kernels run on the same file. Parley uses it for an LM head only
// (app/model/quant/kquants.py, PARLEY_INT8_HEAD), where a head of 262,144 rows (Gemma 3)
// is most of a step's arithmetic at 32 rows.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kQ8Path = "AVX-512 VNNI (vpdpbusd)";
constexpr bool kQ8Native = true;

// t += w . (the four int8 at p, in every lane): vpdpbusd with its operand broadcast from
// memory ({1to16}), one instruction where the intrinsics give two (GCC loads the dword into
// a register first).
inline void dpbusd_broadcast(__m512i& t, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(t) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// The words n and 16 + n of a chunk's 64 bytes (row n's k pairs (4c, 4c + 1) and (4c + 2,
// 4c + 3)) side by side: dword n then holds row n's four codes in k order, vpdpbusd's
// operand.
inline __m512i dword_order() {
  alignas(64) static constexpr uint16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                      21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(kOrder);
}

// Rows [0, MR) against one tile: codes (KB x 8 chunks of 64 bytes: bytes 32h + 2n + j of
// chunk c are q(n, 4c + 2h + j)), scales d [KB][16]; xq (MR x K int8, lda apart), its s and
// bias (KB apart); y 16 fp32 a row, ldy apart.
template <int MR>
inline void q8_tile(const uint8_t* codes, const c10::Half* d, int64_t KB, const int8_t* xq,
                    int64_t lda, const float* s, const int32_t* bias, float* y, int64_t ldy,
                    int64_t tile_bytes) {
  const __m512i order = dword_order();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // q + 128, as unsigned
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_group(codes, tile_bytes, 1, 1, b, 8 * 64);
    __m512i w[8];
    for (int c = 0; c < 8; ++c)
      w[c] = _mm512_xor_si512(
          _mm512_permutexvar_epi16(order, _mm512_loadu_si512(codes + (b * 8 + c) * 64)), flip);
    const __m512 db =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kTile)));
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int8_t* xr = xq + r * lda + b * kGroup;
      // Two chains (their latency, not their sum, bounds one row): the integers add exactly.
      __m512i t0 = _mm512_set1_epi32(bias[r * KB + b]), t1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        dpbusd_broadcast(t0, w[c], xr + 4 * c);
        dpbusd_broadcast(t1, w[c + 1], xr + 4 * c + 4);
      }
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)),
                                     _mm512_set1_ps(s[r * KB + b]));
      acc[r] = _mm512_fmadd_ps(db, v, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#else
constexpr const char* kQ8Path = "portable C++ (integer sums)";
constexpr bool kQ8Native = false;

template <int MR>
inline void q8_tile(const uint8_t* codes, const c10::Half* d, int64_t KB, const int8_t* xq,
                    int64_t lda, const float* s, const int32_t*, float* y, int64_t ldy,
                    int64_t) {
  for (int r = 0; r < MR; ++r) {
    float acc[kTile] = {};
    for (int64_t b = 0; b < KB; ++b)
      for (int n = 0; n < kTile; ++n) {
        int32_t t = 0;
        for (int64_t c = 0; c < 8; ++c)
          for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 2; ++j) {
              const int8_t w = static_cast<int8_t>(codes[(b * 8 + c) * 64 + 32 * h + 2 * n + j]);
              t += w * xq[r * lda + b * kGroup + 4 * c + 2 * h + j];
            }
        const float v = static_cast<float>(t) * s[r * KB + b];
        acc[n] = std::fma(static_cast<float>(d[b * kTile + n]), v, acc[n]);
      }
    std::memcpy(y + r * ldy, acc, sizeof acc);
  }
}
#endif

// A row of x (K floats) as q8_matmul's activations: codes, per-group scales, and -128 times
// each group's sum of codes (what the unsigned codes of the VNNI path add too much). With
// AVX-512 the same operations on 16 lanes: the maximum is exact in any order, and the
// conversion rounds half to even as nearbyint does.
inline void quantize_q8_row(const float* x, int64_t K, int8_t* q, float* s, int32_t* bias) {
  for (int64_t b = 0; b < K / kGroup; ++b) {
    const float* xb = x + b * kGroup;
#ifdef __AVX512F__
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    const auto codes = [&](__m512 v) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
      return _mm512_max_epi32(_mm512_min_epi32(c, top), bottom);
    };
    const __m512i ql = codes(lo), qh = codes(hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kGroup), _mm512_cvtepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kGroup + 16), _mm512_cvtepi32_epi8(qh));
    s[b] = scale;
    bias[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
#else
    float amax = 0.f;
    for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kGroup; ++k) {
      const float v = std::clamp(std::nearbyint(xb[k] * inv), -127.f, 127.f);
      q[b * kGroup + k] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    s[b] = scale;
    bias[b] = -128 * sum;
#endif
  }
}

// x (M x K floats) quantized row by row, rows split across threads: q (M x K), s and bias
// (M x K / 32).
struct Q8Activations {
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> bias;
  Q8Activations(const float* x, int64_t M, int64_t K)
      : q(M * K), s(M * K / kGroup), bias(M * K / kGroup) {
    const int64_t KB = K / kGroup;
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_q8_row(x + r * K, K, q.data() + r * K, s.data() + r * KB, bias.data() + r * KB);
    });
  }
};

std::string q4_path() { return amx_on() ? "AMX (tdpbf16ps)" : kPath; }
std::string group_path() { return kPath; }  // group_matmul never runs on AMX's tiles

// Whether the AMX path may run (where it can); returns whether it runs now.
bool q4_amx(c10::optional<bool> want) {
  if (want.has_value()) amx_wanted.store(*want);
  return amx_on();
}

}  // namespace

namespace parley_kernels {

// Whether AMX runs in this process now: cpu_kernels.cpp's attention takes the same switch,
// so a process's linears and attention change paths together.
bool amx_enabled() { return amx_on(); }

// y (M, tiles x 16) = x W^T in `want`, for either op: x rounded to bf16, its group sums
// where there are offsets, then AMX (q4_matmul's format, where it runs) or run<B>.
template <int B, typename S>
at::Tensor tiled_matmul(const at::Tensor& x, const uint8_t* codes, const S* d, const S* m,
                        int64_t tiles, int64_t G, int base, at::ScalarType want, bool amx) {
  (void)amx;  // only where the build has AMX
  const int64_t M = x.size(0), K = x.size(1), N = tiles * kTile, KB = K / G;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // fp32 activations round here
  auto y = at::empty({M, N}, x.options().dtype(want));
  if (M == 0 || N == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>());
  std::vector<float> xs(m != nullptr ? M * KB : 0);
  if (m != nullptr)
    at::parallel_for(0, M * KB, 1024, [&](int64_t g0, int64_t g1) {
      group_sums(xp + g0 * G, g1 - g0, xs.data() + g0, G);
    });
  const int64_t tile_bytes = (K / 4) * chunk_bytes(B);
  const auto go = [&](auto* out) {
    using Out = std::remove_pointer_t<decltype(out)>;
    const Operands<S, Out> o{codes, d, m, xp, xs.data(), out, K, KB, N, tile_bytes, KB * kTile, G};
#ifdef PARLEY_AMX
    if constexpr (B == 4 && std::is_same_v<S, c10::Half>) {
      if (amx) return run_amx(o, M, tiles);
    }
#endif
    run<B>(o, M, tiles, base);
  };
  if (want == at::kFloat) go(y.data_ptr<float>());
  else go(y.data_ptr<c10::BFloat16>());
  return y;
}

// x (M, K) fp32 or bf16 (rounded to bf16); codes, d, m as app/model/quant/int4.py's
// parley_layout packs an (N, K) weight, N = 16 x d's first dimension. y (M, N) in
// out_dtype (default: x's), from fp32 sums.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "q4_matmul: x must be (M, K)");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "q4_matmul: K must be a multiple of ", kGroup);
  TORCH_CHECK(d.dim() == 3 && d.size(1) == K / kGroup && d.size(2) == kTile,
              "q4_matmul: scales must be (tiles, K / 32, 16)");
  const int64_t tiles = d.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * (K / 4) * kChunk,
              "q4_matmul: codes must be the packed uint8 layout for (N, K)");
  for (const auto* s : {&d, &m})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->is_contiguous() && s->sizes() == d.sizes(),
                "q4_matmul: scales must be fp16 (tiles, K / 32, 16)");
  const auto want = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(want == at::kFloat || want == at::kBFloat16, "q4_matmul: out in fp32 or bf16");
  return tiled_matmul<4>(x, codes.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(),
                         m.data_ptr<c10::Half>(), tiles, kGroup, 0, want, amx_on());
}

// group_matmul: GGUF's other group formats as stored (app/model/quant/kquants.py's
// TiledGroupWeight): w[n, k] = scale[n, g] * q[n, k] + offset[n, g] per group g of `group`
// (16 or 32) along K, q an integer of `bits` (4, 5, 6 or 8; code_value's layouts, `base`
// the integer a stored 0 stands for). x (M, K) fp32 or bf16 (rounded to bf16); codes uint8
// (tiles, K / 4, 32 or 64 bytes); scales and offsets (tiles, K / group, 16), both fp32 or
// both fp16 (where the file's values are fp16: half the bytes, the same floats), offsets
// optional. y (M, 16 tiles) in out_dtype (default: x's). Per output element the arithmetic
// of q4_matmul's vector path (its order), for any M, on any CPU.
at::Tensor group_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t group, int64_t bits,
                        int64_t base, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "group_matmul: x must be (M, K)");
  TORCH_CHECK(group == 16 || group == 32, "group_matmul: group must be 16 or 32");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "group_matmul: codes of 4, 5, 6 or 8 bits");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % group == 0, "group_matmul: K must be a multiple of the group");
  const auto st = scales.scalar_type();
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == K / group && scales.size(2) == kTile &&
                  (st == at::kFloat || st == at::kHalf) && scales.is_contiguous(),
              "group_matmul: scales must be fp32 or fp16 (tiles, K / group, 16)");
  const int64_t tiles = scales.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * (K / 4) * chunk_bytes(static_cast<int>(bits)),
              "group_matmul: codes must be the tiled uint8 layout for (N, K) at ", bits, " bits");
  if (offsets.has_value())
    TORCH_CHECK(offsets->scalar_type() == st && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(),
                "group_matmul: offsets must be like the scales");
  const auto want = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(want == at::kFloat || want == at::kBFloat16, "group_matmul: out in fp32 or bf16");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int b = static_cast<int>(base);
  const auto go = [&](const auto* dp) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(dp)>>;
    const S* mp = offsets.has_value() ? offsets->data_ptr<S>() : nullptr;
    switch (bits) {
      case 4: return tiled_matmul<4>(x, cp, dp, mp, tiles, group, b, want, false);
      case 5: return tiled_matmul<5>(x, cp, dp, mp, tiles, group, b, want, false);
      case 6: return tiled_matmul<6>(x, cp, dp, mp, tiles, group, b, want, false);
      default: return tiled_matmul<8>(x, cp, dp, mp, tiles, group, b, want, false);
    }
  };
  return st == at::kHalf ? go(scales.data_ptr<c10::Half>()) : go(scales.data_ptr<float>());
}


// q8_matmul (above): x (M, K) fp32 or bf16; codes uint8 (tiles, K / 4, 64), group_matmul's
// 8-bit layout; scales fp16 (tiles, K / 32, 16). y (M, 16 tiles) fp32.
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2, "q8_matmul: x must be (M, K)");
  const int64_t M = x.size(0), K = x.size(1), KB = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "q8_matmul: K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == KB && scales.size(2) == kTile &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "q8_matmul: scales must be fp16 (tiles, K / 32, 16)");
  const int64_t tiles = scales.size(0), tile_bytes = (K / 4) * 64;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * tile_bytes,
              "q8_matmul: codes must be group_matmul's 8-bit layout for (N, K)");
  auto y = at::empty({M, tiles * kTile}, x.options().dtype(at::kFloat));
  if (M == 0 || tiles == 0) return y;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const Q8Activations a(xf.data_ptr<float>(), M, K);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::Half* dp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t N = tiles * kTile;
  const auto rows = [&](auto mr, int64_t r, int64_t t) {
    constexpr int MR = decltype(mr)::value;
    q8_tile<MR>(cp + t * tile_bytes, dp + t * KB * kTile, KB, a.q.data() + r * K, K,
                a.s.data() + r * KB, a.bias.data() + r * KB, yp + r * N + t * kTile, N,
                tile_bytes);
  };
  // Threads split the tiles (a few an item for a small M, as run's split); a tile's rows go
  // 16 at a time, then 8, 4, 2, 1, while its codes stay in L1.
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, M * KB));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t r = 0;
      for (; r + 16 <= M; r += 16) rows(std::integral_constant<int, 16>{}, r, t);
      if (r + 8 <= M) rows(std::integral_constant<int, 8>{}, r, t), r += 8;
      if (r + 4 <= M) rows(std::integral_constant<int, 4>{}, r, t), r += 4;
      if (r + 2 <= M) rows(std::integral_constant<int, 2>{}, r, t), r += 2;
      if (r < M) rows(std::integral_constant<int, 1>{}, r, t);
    }
  });
  return y;
}

std::string q8_path() { return kQ8Path; }
bool q8_native() { return kQ8Native; }
}  // namespace parley_kernels

TORCH_LIBRARY_FRAGMENT(parley, m) {
  m.def("q4_matmul(Tensor x, Tensor codes, Tensor d, Tensor m, ScalarType? out_dtype) -> Tensor");
  m.def("q4_path() -> str", &q4_path);
  m.def("group_path() -> str", &group_path);
  m.def("q8_path() -> str", &parley_kernels::q8_path);
  m.def("q8_native() -> bool", &parley_kernels::q8_native);
  m.def("q8_matmul(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_amx(bool? enable=None) -> bool", &q4_amx);
  m.def(
      "group_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group, int bits, "
      "int base, ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(parley, CPU, m) {
  m.impl("q4_matmul", &parley_kernels::q4_matmul);
  m.impl("group_matmul", &parley_kernels::group_matmul);
  m.impl("q8_matmul", &parley_kernels::q8_matmul);
}
