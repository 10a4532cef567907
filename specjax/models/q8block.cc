// specjax's block int8 matmul on CPU (XLA FFI custom call). Built on first use by
// specjax/models/q8.py (g++ -O3 -shared -fPIC -std=c++17 -ffp-contract=off).
//
// Weights: codes uint8 and per block of 32 consecutive inputs (k) a scale d and a minimum m:
//   w[k, n] = d[b, n] * codes[k, n] + m[b, n],  b = k / 32.
//   KN: codes [K, N] (N contiguous), scale [2, K/32, N]  (scale[0] = d, scale[1] = m)
//   NK: codes [N, K] (K contiguous), scale [2, N, K/32]  (the tied embedding as the LM head)
// Activations x float32 [M, K], per row and block (exact spec; q8.py's block_matmul_np):
//   s1 = max|x| / 127 (1 if 0); q1 = clamp(rint(x / s1), +-127); r = x - s1 * q1;
//   s2 = max|r| / 127 (1 if 0); q2 = clamp(rint(r / s2), +-127); X = halving-tree sum of x;
//   I1[n] = sum q1 * codes, I2[n] = sum q2 * codes  (int32, exact);
//   c[n]  = (d * ((s1 * I1) + (s2 * I2))) + (m * X)  (float32, each op rounded, no FMA);
//   y     = c(b = 0) + c(1) + ... in increasing b.
// Every float op is the same per element on every path, the integer sums are exact, so the result
// is bitwise the same on the AVX-512 VNNI, AVX2 and scalar paths, for every M and row grouping,
// and for any split of N over threads (each row's result depends on that row only).
// y is accumulated from -0.0f: -0.0f + c == c bitwise, so "y = c at b = 0, then y + c" holds.
//
// Handlers: Q8BlockKN, Q8BlockNK: (x f32[M,K], codes u8, scale f32) -> y f32[M,N]; attribute
// threads (int64): the most threads over N (1: the calling thread only); calls of fewer than
// SPECJAX_Q8_MIN_PAR_ROWS rows (64) run on the calling thread whatever it says. The
// other threads are a persistent pool (cpu_pool.h) that sleeps between calls (SPECJAX_Q8_SPIN_US:
// spin that long first; default 0).
// K must be a multiple of 32 (the Python wrapper uses the jnp reference otherwise).

#include <immintrin.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "xla/ffi/api/ffi.h"

#include "cpu_pool.h"

namespace ffi = xla::ffi;

namespace {

using specjax_cpu::AlignedBuf;
using specjax_cpu::env_int;
using specjax_cpu::pool;

constexpr int kB = 32;  // inputs per block

#define T_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define T_AVX2 "avx2"

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

static Isa best_isa() {
  __builtin_cpu_init();
  Isa best = kScalar;
  if (__builtin_cpu_supports("avx2")) best = kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    best = kAvx512Vnni;
  return best;
}

static const Isa g_best = best_isa();
static Isa g_isa = g_best;
// Tuning knobs (environment, read once at load; measured on a 2-core Zen 4; none changes a result):
// KN (VNNI): a chunk spanning whole rows prefetches the next block's rows (and d, m) into L2;
// a narrower chunk prefetches the tile SPECJAX_Q8_PF tiles ahead. The permuted y of a chunk
// takes at most SPECJAX_Q8_YBUDGET bytes (the chunk's width follows from M).
static const int g_pf_linear = env_int("SPECJAX_Q8_PFLIN", 1);
static const int g_pf_scales = env_int("SPECJAX_Q8_PFS", 1);
static const int g_pf = env_int("SPECJAX_Q8_PF", 4);
static const int64_t g_ybudget = env_int("SPECJAX_Q8_YBUDGET", 256 << 10);
// NK (VNNI): prefetch the group of 16 rows SPECJAX_Q8_PFG groups ahead (into L1, or L2 with
// SPECJAX_Q8_PFG_T1=1). AVX2: prefetch SPECJAX_Q8_PFB blocks ahead.
static const int g_pfg = env_int("SPECJAX_Q8_PFG", 1);
static const int g_pfg_hint = env_int("SPECJAX_Q8_PFG_T1", 0);
static const int g_pfb = env_int("SPECJAX_Q8_PFB", 2);
// threads > 1 only for calls of at least this many rows M (prefill chunks, large batches): measured
// on the default pair at batch 1 (2 cores), splitting decode's calls made decode slower (60.3 tokens/s
// on one thread; 50.7 with the head and the larger layers split, the helper spinning 100 us between
// calls; 56.4 with it sleeping at once): a split halves each KN code row's contiguous run, and a
// helper that spins takes a core from XLA's own threads between the kernel's calls.
static const int64_t g_min_par_rows = env_int("SPECJAX_Q8_MIN_PAR_ROWS", 64);

// ------------------------------------------------------------------ activations (steps 1-5)
struct Act {
  int M = 0, K = 0, nb = 0;
  int8_t* q1 = nullptr;   // [M][K]
  int8_t* q2 = nullptr;   // [M][K]
  int16_t* w1 = nullptr;  // [M][K] q1 as int16 (AVX2 path)
  int16_t* w2 = nullptr;  // [M][K]
  float* s1 = nullptr;    // [M][nb]
  float* s2 = nullptr;
  float* X = nullptr;
};

static void quant_block_scalar(const float* x, int8_t* q1, int8_t* q2, float* s1o,
                               float* s2o, float* Xo) {
  float a1 = 0.f;
  for (int i = 0; i < kB; ++i) a1 = std::max(a1, std::fabs(x[i]));
  float s1 = a1 / 127.0f;
  if (a1 == 0.f) s1 = 1.0f;
  float r[kB];
  float a2 = 0.f;
  for (int i = 0; i < kB; ++i) {
    float v = std::nearbyint(std::min(127.f, std::max(-127.f, x[i] / s1)));
    q1[i] = (int8_t)v;
    float p = s1 * v;
    r[i] = x[i] - p;
    a2 = std::max(a2, std::fabs(r[i]));
  }
  float s2 = a2 / 127.0f;
  if (a2 == 0.f) s2 = 1.0f;
  for (int i = 0; i < kB; ++i)
    q2[i] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, r[i] / s2)));
  float t[16];
  for (int j = 0; j < 16; ++j) t[j] = x[j] + x[j + 16];
  for (int h = 8; h >= 1; h /= 2)
    for (int j = 0; j < h; ++j) t[j] = t[j] + t[j + h];
  *s1o = s1;
  *s2o = s2;
  *Xo = t[0];
}

__attribute__((target(T_AVX2))) static inline float hmax8(__m256 m) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm_cvtss_f32(m4);
}

// q = clamp(x / s) rounded half to even, as int32 (the same value as the scalar path).
__attribute__((target(T_AVX2))) static inline __m256i qround8(__m256 x, __m256 s) {
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(x, s)));
  v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvttps_epi32(v);
}

__attribute__((target(T_AVX2))) static inline void store_q8(__m256i q[4], int8_t* out) {
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)out, p);
}

__attribute__((target(T_AVX2))) static void quant_block_avx2(const float* x, int8_t* q1,
                                                             int8_t* q2, float* s1o, float* s2o,
                                                             float* Xo) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], r[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
  }
  float a1 = hmax8(m);
  float s1 = a1 / 127.0f;
  if (a1 == 0.f) s1 = 1.0f;
  __m256 sv = _mm256_set1_ps(s1);
  __m256i qi[4];
  m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    qi[i] = qround8(v[i], sv);
    r[i] = _mm256_sub_ps(v[i], _mm256_mul_ps(sv, _mm256_cvtepi32_ps(qi[i])));
    m = _mm256_max_ps(m, _mm256_and_ps(r[i], absmask));
  }
  store_q8(qi, q1);
  float a2 = hmax8(m);
  float s2 = a2 / 127.0f;
  if (a2 == 0.f) s2 = 1.0f;
  sv = _mm256_set1_ps(s2);
  for (int i = 0; i < 4; ++i) qi[i] = qround8(r[i], sv);
  store_q8(qi, q2);
  // halving tree: t = x[0:16] + x[16:32], then 8, 4, 2, 1
  __m256 t0 = _mm256_add_ps(v[0], v[2]), t1 = _mm256_add_ps(v[1], v[3]);  // t[0:8], t[8:16]
  __m256 u = _mm256_add_ps(t0, t1);                                         // t[0:8]
  __m128 w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));  // t[0:4]
  w = _mm_add_ps(w, _mm_movehl_ps(w, w));                                   // t[0:2]
  w = _mm_add_ss(w, _mm_shuffle_ps(w, w, 1));
  *s1o = s1;
  *s2o = s2;
  *Xo = _mm_cvtss_f32(w);
}

static void quantize(const float* x, Act& a, Isa isa) {
  for (int m = 0; m < a.M; ++m)
    for (int b = 0; b < a.nb; ++b) {
      const size_t o = (size_t)m * a.K + (size_t)b * kB, os = (size_t)m * a.nb + b;
      if (isa >= kAvx2)
        quant_block_avx2(x + o, a.q1 + o, a.q2 + o, a.s1 + os, a.s2 + os, a.X + os);
      else
        quant_block_scalar(x + o, a.q1 + o, a.q2 + o, a.s1 + os, a.s2 + os, a.X + os);
    }
  if (isa == kAvx2) {
    const size_t n = (size_t)a.M * a.K;
    for (size_t i = 0; i < n; ++i) {
      a.w1[i] = a.q1[i];
      a.w2[i] = a.q2[i];
    }
  }
}

// ------------------------------------------------------------------ scalar paths
// c = (d * ((s1 * I1) + (s2 * I2))) + (m * X), each op rounded to float32 (-ffp-contract=off).
static inline float combine(float d, float mn, float s1, float s2, float X, int32_t I1,
                            int32_t I2) {
  float t1 = s1 * (float)I1;
  float t2 = s2 * (float)I2;
  float u = t1 + t2;
  float v = d * u;
  float w = mn * X;
  return v + w;
}

// columns [n0, n1) of y, all rows; the code of (k, n) at codes[k * ck + n * cn], the scale and
// offset of (block b, n) at D / Mn[b * sb + n * sn] (KN: ck = N, cn = 1, sb = N, sn = 1; NK: the
// transposes)
static void blocks_scalar(const Act& a, const uint8_t* codes, size_t ck, size_t cn, const float* D,
                          const float* Mn, size_t sb, size_t sn, int N, int n0, int n1, float* y) {
  const int K = a.K, nb = a.nb;
  for (int m = 0; m < a.M; ++m)
    for (int n = n0; n < n1; ++n) {
      float acc = -0.0f;
      for (int b = 0; b < nb; ++b) {
        int32_t I1 = 0, I2 = 0;
        for (int i = 0; i < kB; ++i) {
          const int k = b * kB + i;
          const int32_t c = codes[(size_t)k * ck + (size_t)n * cn];
          I1 += c * a.q1[(size_t)m * K + k];
          I2 += c * a.q2[(size_t)m * K + k];
        }
        const size_t os = (size_t)m * nb + b;
        const size_t at = (size_t)b * sb + (size_t)n * sn;
        acc = acc + combine(D[at], Mn[at], a.s1[os], a.s2[os], a.X[os], I1, I2);
      }
      y[(size_t)m * N + n] = acc;
    }
}

static void kn_scalar(const Act& a, const uint8_t* codes, const float* scale, int N, int n0,
                      int n1, float* y) {
  blocks_scalar(a, codes, N, 1, scale, scale + (size_t)a.nb * N, N, 1, N, n0, n1, y);
}

static void nk_scalar(const Act& a, const uint8_t* codes, const float* scale, int N, int n0,
                      int n1, float* y) {
  blocks_scalar(a, codes, 1, a.K, scale, scale + (size_t)N * a.nb, 1, a.nb, N, n0, n1, y);
}

// ------------------------------------------------------------------ AVX-512 VNNI, KN
// A tile of 64 columns. Per k-quad (4 rows of codes, N bytes apart), 4 x 64 bytes are interleaved
// into 4 registers of vpdpbusd's [col: k0 k1 k2 k3] dwords with unpack{lo,hi}_epi{8,16}:
// register j, 128-bit lane L, dword i holds column 16 L + 4 j + i. The scales d, m of the block
// are brought into the same order (a 4 x 4 transposition of 128-bit lanes), y is accumulated in
// that order and transposed back at the end of the tile (the transposition is its own inverse).
struct KnScratch {
  AlignedBuf<__m512i> w;  // [8 quads][4]: the block's interleaved codes
  AlignedBuf<float> ds;   // [2][64]: d, m permuted
  AlignedBuf<float> yp;   // [M][64]: y permuted
};

__attribute__((target(T_AVX512))) static inline void transpose_lanes(__m512 n0, __m512 n1,
                                                                      __m512 n2, __m512 n3,
                                                                      __m512* out) {
  __m512 t0 = _mm512_shuffle_f32x4(n0, n1, 0x44), t1 = _mm512_shuffle_f32x4(n0, n1, 0xEE);
  __m512 t2 = _mm512_shuffle_f32x4(n2, n3, 0x44), t3 = _mm512_shuffle_f32x4(n2, n3, 0xEE);
  out[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  out[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  out[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  out[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// R rows (m0 .. m0+R-1) of one block: registers j in [J0, J0 + NJ).
template <int R, int NJ>
__attribute__((target(T_AVX512))) static inline void kn_rows_vnni(
    const __m512i* __restrict W, const float* __restrict ds, const Act& a, int m0, int b,
    float* __restrict yp, size_t ldp, int J0) {
  __m512i acc1[R][NJ], acc2[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) acc1[r][j] = acc2[r][j] = _mm512_setzero_si512();
  const size_t K = a.K;
  const int8_t* q1 = a.q1 + (size_t)m0 * K + (size_t)b * kB;
  const int8_t* q2 = a.q2 + (size_t)m0 * K + (size_t)b * kB;
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    for (int j = 0; j < NJ; ++j) {
      const __m512i w = _mm512_load_si512(W + 4 * q + J0 + j);
      for (int r = 0; r < R; ++r) {
        int32_t v1, v2;
        std::memcpy(&v1, q1 + r * K + 4 * q, 4);
        std::memcpy(&v2, q2 + r * K + 4 * q, 4);
        acc1[r][j] = _mm512_dpbusd_epi32(acc1[r][j], w, _mm512_set1_epi32(v1));
        acc2[r][j] = _mm512_dpbusd_epi32(acc2[r][j], w, _mm512_set1_epi32(v2));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const size_t os = (size_t)(m0 + r) * a.nb + b;
    const __m512 s1 = _mm512_set1_ps(a.s1[os]), s2 = _mm512_set1_ps(a.s2[os]);
    const __m512 X = _mm512_set1_ps(a.X[os]);
    float* yr = yp + (size_t)r * ldp;
    for (int j = 0; j < NJ; ++j) {
      const int jj = J0 + j;
      __m512 t1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(acc1[r][j]));
      __m512 t2 = _mm512_mul_ps(s2, _mm512_cvtepi32_ps(acc2[r][j]));
      __m512 v = _mm512_mul_ps(_mm512_load_ps(ds + 16 * jj), _mm512_add_ps(t1, t2));
      __m512 w = _mm512_mul_ps(_mm512_load_ps(ds + 64 + 16 * jj), X);
      __m512 y = _mm512_add_ps(_mm512_load_ps(yr + 16 * jj), _mm512_add_ps(v, w));
      _mm512_store_ps(yr + 16 * jj, y);
    }
  }
}

// A chunk of C tiles (columns n0 .. n0 + 64 C): codes at column n0 (row stride ldc), scales d, m at
// column n0 (row stride lds); outputs to y (row stride ldy), the first `valid` columns of the chunk.
// Block-outer, tile-inner: the chunk's 32 rows of codes of a block are read as C consecutive 64-byte
// pieces per row (long sequential runs; the next tiles' lines are prefetched), the permuted y of the
// chunk stays in a scratch of M x 64 C floats (chunks are sized to keep it in cache).
__attribute__((target(T_AVX512))) static void kn_chunk_vnni(const Act& a, const uint8_t* codes,
                                                            size_t ldc, const float* D,
                                                            const float* Mn, size_t lds, int C,
                                                            float* y, size_t ldy, int valid,
                                                            KnScratch& s) {
  const int M = a.M, nb = a.nb;
  const size_t ldp = (size_t)64 * C;
  __m512i* W = s.w.get(32);
  float* ds = s.ds.get(128);
  float* yp = s.yp.get((size_t)M * ldp);
  const __m512 nz = _mm512_set1_ps(-0.0f);
  for (size_t i = 0; i < (size_t)M * 4 * C; ++i) _mm512_store_ps(yp + 16 * i, nz);
  const bool linear = g_pf_linear && (size_t)64 * C == ldc;
  for (int b = 0; b < nb; ++b) {
    for (int t = 0; t < C; ++t) {
      const uint8_t* cb = codes + (size_t)b * kB * ldc + 64 * t;
      if (linear) {  // the chunk spans whole rows: the next block's rows are one contiguous region
        if (b + 1 < nb) {
          const uint8_t* pb = codes + (size_t)(b + 1) * kB * ldc + (size_t)t * kB * 64;
          for (int i = 0; i < kB; ++i) _mm_prefetch((const char*)(pb + 64 * i), _MM_HINT_T1);
          if (g_pf_scales) {
            const float* pd = D + (size_t)(b + 1) * lds + 64 * t;
            const float* pm = Mn + (size_t)(b + 1) * lds + 64 * t;
            for (int i = 0; i < 4; ++i) {
              _mm_prefetch((const char*)(pd + 16 * i), _MM_HINT_T1);
              _mm_prefetch((const char*)(pm + 16 * i), _MM_HINT_T1);
            }
          }
        }
      } else if (g_pf > 0) {  // the lines of the tile g_pf tiles ahead (in the next block after the last)
        int tb = b, tt = t + g_pf;
        if (tt >= C) tt -= C, ++tb;
        if (tb < nb && tt < C) {
          const uint8_t* pb = codes + (size_t)tb * kB * ldc + 64 * tt;
          for (int k = 0; k < kB; ++k) _mm_prefetch((const char*)(pb + k * ldc), _MM_HINT_T0);
        }
      }
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const uint8_t* p = cb + (size_t)(4 * q) * ldc;
        __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + ldc);
        __m512i r2 = _mm512_loadu_si512(p + 2 * ldc), r3 = _mm512_loadu_si512(p + 3 * ldc);
        __m512i l01 = _mm512_unpacklo_epi8(r0, r1), h01 = _mm512_unpackhi_epi8(r0, r1);
        __m512i l23 = _mm512_unpacklo_epi8(r2, r3), h23 = _mm512_unpackhi_epi8(r2, r3);
        _mm512_store_si512(W + 4 * q + 0, _mm512_unpacklo_epi16(l01, l23));
        _mm512_store_si512(W + 4 * q + 1, _mm512_unpackhi_epi16(l01, l23));
        _mm512_store_si512(W + 4 * q + 2, _mm512_unpacklo_epi16(h01, h23));
        _mm512_store_si512(W + 4 * q + 3, _mm512_unpackhi_epi16(h01, h23));
      }
      const float* db = D + (size_t)b * lds + 64 * t;
      const float* mb = Mn + (size_t)b * lds + 64 * t;
      __m512 tr[4];
      transpose_lanes(_mm512_loadu_ps(db), _mm512_loadu_ps(db + 16), _mm512_loadu_ps(db + 32),
                      _mm512_loadu_ps(db + 48), tr);
      for (int j = 0; j < 4; ++j) _mm512_store_ps(ds + 16 * j, tr[j]);
      transpose_lanes(_mm512_loadu_ps(mb), _mm512_loadu_ps(mb + 16), _mm512_loadu_ps(mb + 32),
                      _mm512_loadu_ps(mb + 48), tr);
      for (int j = 0; j < 4; ++j) _mm512_store_ps(ds + 64 + 16 * j, tr[j]);
      float* yt = yp + 64 * t;
      int m = 0;
      for (; m + 4 <= M; m += 4) {
        kn_rows_vnni<4, 2>(W, ds, a, m, b, yt + m * ldp, ldp, 0);
        kn_rows_vnni<4, 2>(W, ds, a, m, b, yt + m * ldp, ldp, 2);
      }
      for (; m + 2 <= M; m += 2) kn_rows_vnni<2, 4>(W, ds, a, m, b, yt + m * ldp, ldp, 0);
      for (; m < M; ++m) kn_rows_vnni<1, 4>(W, ds, a, m, b, yt + m * ldp, ldp, 0);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < C; ++t) {
      const float* yr = yp + m * ldp + 64 * t;
      __m512 tr[4];
      transpose_lanes(_mm512_load_ps(yr), _mm512_load_ps(yr + 16), _mm512_load_ps(yr + 32),
                      _mm512_load_ps(yr + 48), tr);
      float* out = y + (size_t)m * ldy + 64 * t;
      const int v = std::min(64, valid - 64 * t);
      if (v == 64) {
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + 16 * j, tr[j]);
      } else {
        alignas(64) float tmp[64];
        for (int j = 0; j < 4; ++j) _mm512_store_ps(tmp + 16 * j, tr[j]);
        std::memcpy(out, tmp, sizeof(float) * v);
      }
    }
}

// ------------------------------------------------------------------ AVX-512 VNNI, NK
// A group of 16 columns (rows of codes). Per block, register p holds the block's 32 codes of
// columns 2p (low 256 bits) and 2p+1 (high), i.e. 8 dwords (k-quads) per column; an 8 x 8 dword
// transposition in both halves at once (unpack epi32 / epi64, vpermt2q) gives register q = k-quad
// q of all 16 columns, in the order kNkOrder (low half the even columns, high half the odd), so
// each row needs 8 vpdpbusd per level with a broadcast activation quad and no horizontal sums. The
// transposition is done once per block for all rows; d, m are gathered in that order, y is
// accumulated in it and permuted back at the end.
static const int kNkOrder[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

struct NkScratch {
  AlignedBuf<float> yp;  // [M][16]
};

__attribute__((target(T_AVX512))) static inline void transpose8x8x2(__m512i* r) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i+3
    __m512i* tt = t + 4 * i;
    u[4 * i + 0] = _mm512_unpacklo_epi64(tt[0], tt[2]);  // quads 0 | 4 of rows 4i..4i+3
    u[4 * i + 1] = _mm512_unpackhi_epi64(tt[0], tt[2]);  // 1 | 5
    u[4 * i + 2] = _mm512_unpacklo_epi64(tt[1], tt[3]);  // 2 | 6
    u[4 * i + 3] = _mm512_unpackhi_epi64(tt[1], tt[3]);  // 3 | 7
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm512_permutex2var_epi64(u[q], lo, u[4 + q]);
    r[q + 4] = _mm512_permutex2var_epi64(u[q], hi, u[4 + q]);
  }
}

// codes: row n0 (row stride K); D, Mn: d, m of column n0 (row stride nb); valid columns <= 16;
// ahead: codes of a later group to prefetch (16 K contiguous bytes), or null.
__attribute__((target(T_AVX512))) static void nk_group_vnni(const Act& a, const uint8_t* codes,
                                                            const float* D, const float* Mn,
                                                            float* y, size_t ldy, int valid,
                                                            const uint8_t* ahead, NkScratch& s) {
  const int M = a.M, nb = a.nb;
  const size_t K = a.K;
  float* yp = s.yp.get((size_t)M * 16);
  // d, m of block b in kNkOrder: gathered (stride nb), the missing columns of a partial group 0
  const __m512i gidx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), _mm512_set1_epi32(nb));
  __mmask16 gmask = 0;
  for (int p = 0; p < 16; ++p)
    if (kNkOrder[p] < valid) gmask |= (__mmask16)(1u << p);
  const __m512 nz = _mm512_set1_ps(-0.0f);
  for (int m = 0; m < M; ++m) _mm512_store_ps(yp + 16 * m, nz);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* cb = codes + (size_t)b * kB;
    if (ahead) {  // 16 K bytes = 8 lines per block
      const char* pb = (const char*)(ahead + (size_t)b * 512);
      if (g_pfg_hint)
        for (int i = 0; i < 8; ++i) _mm_prefetch(pb + 64 * i, _MM_HINT_T1);
      else
        for (int i = 0; i < 8; ++i) _mm_prefetch(pb + 64 * i, _MM_HINT_T0);
    }
    __m512i W[8];
    for (int p = 0; p < 8; ++p)
      W[p] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(cb + (2 * p) * K))),
          _mm256_loadu_si256((const __m256i*)(cb + (2 * p + 1) * K)), 1);
    transpose8x8x2(W);
    const __m512 d = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), gmask, gidx, D + b, 4);
    const __m512 mn = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), gmask, gidx, Mn + b, 4);
    for (int m = 0; m < M; ++m) {
      const size_t o = (size_t)m * K + (size_t)b * kB, os = (size_t)m * nb + b;
      const int8_t* q1 = a.q1 + o;
      const int8_t* q2 = a.q2 + o;
      __m512i a1[2], a2[2];
      a1[0] = a1[1] = a2[0] = a2[1] = _mm512_setzero_si512();
      for (int q = 0; q < 8; ++q) {
        int32_t v1, v2;
        std::memcpy(&v1, q1 + 4 * q, 4);
        std::memcpy(&v2, q2 + 4 * q, 4);
        a1[q & 1] = _mm512_dpbusd_epi32(a1[q & 1], W[q], _mm512_set1_epi32(v1));
        a2[q & 1] = _mm512_dpbusd_epi32(a2[q & 1], W[q], _mm512_set1_epi32(v2));
      }
      const __m512i I1 = _mm512_add_epi32(a1[0], a1[1]), I2 = _mm512_add_epi32(a2[0], a2[1]);
      __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(a.s1[os]), _mm512_cvtepi32_ps(I1));
      __m512 t2 = _mm512_mul_ps(_mm512_set1_ps(a.s2[os]), _mm512_cvtepi32_ps(I2));
      __m512 v = _mm512_mul_ps(d, _mm512_add_ps(t1, t2));
      __m512 w = _mm512_mul_ps(mn, _mm512_set1_ps(a.X[os]));
      _mm512_store_ps(yp + 16 * m, _mm512_add_ps(_mm512_load_ps(yp + 16 * m), _mm512_add_ps(v, w)));
    }
  }
  // position of column c in kNkOrder
  const __m512i back = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int m = 0; m < M; ++m) {
    __m512 v = _mm512_permutexvar_ps(back, _mm512_load_ps(yp + 16 * m));
    if (valid == 16)
      _mm512_storeu_ps(y + (size_t)m * ldy, v);
    else
      _mm512_mask_storeu_ps(y + (size_t)m * ldy, (__mmask16)((1u << valid) - 1), v);
  }
}

// ------------------------------------------------------------------ AVX2, KN
// A tile of 16 columns: per pair of rows (k, k+1), 2 x 16 bytes are interleaved (unpack lo/hi) and
// widened to int16 pairs [col: k k+1] for vpmaddwd, natural column order.
struct Avx2Scratch {
  AlignedBuf<__m256i> w;  // KN: [16 pairs][2]; NK: [8 cols][2]
  AlignedBuf<float> ds;
  AlignedBuf<float> yp;
};

__attribute__((target(T_AVX2))) static void kn_tile_avx2(const Act& a, const uint8_t* codes,
                                                         size_t ldc, const float* D,
                                                         const float* Mn, size_t lds, float* y,
                                                         size_t ldy, int valid, Avx2Scratch& s) {
  const int M = a.M, nb = a.nb;
  const size_t K = a.K;
  __m256i* W = s.w.get(32);
  float* yp = s.yp.get((size_t)M * 16);
  const __m256 nz = _mm256_set1_ps(-0.0f);
  for (size_t i = 0; i < (size_t)M * 2; ++i) _mm256_store_ps(yp + 8 * i, nz);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* cb = codes + (size_t)b * kB * ldc;
    if (g_pfb > 0 && b + g_pfb < nb) {
      const uint8_t* pb = cb + (size_t)g_pfb * kB * ldc;
      for (int k = 0; k < kB; ++k) _mm_prefetch((const char*)(pb + k * ldc), _MM_HINT_T0);
    }
    for (int p = 0; p < 16; ++p) {
      const uint8_t* r = cb + (size_t)(2 * p) * ldc;
      __m128i r0 = _mm_loadu_si128((const __m128i*)r), r1 = _mm_loadu_si128((const __m128i*)(r + ldc));
      _mm256_store_si256(W + 2 * p, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1)));
      _mm256_store_si256(W + 2 * p + 1, _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1)));
    }
    const __m256 d0 = _mm256_loadu_ps(D + (size_t)b * lds), d1 = _mm256_loadu_ps(D + (size_t)b * lds + 8);
    const __m256 m0 = _mm256_loadu_ps(Mn + (size_t)b * lds), m1 = _mm256_loadu_ps(Mn + (size_t)b * lds + 8);
    for (int m = 0; m < M; ++m) {
      const int16_t* w1 = a.w1 + (size_t)m * K + (size_t)b * kB;
      const int16_t* w2 = a.w2 + (size_t)m * K + (size_t)b * kB;
      __m256i a10 = _mm256_setzero_si256(), a11 = a10, a20 = a10, a21 = a10;
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        int32_t v1, v2;
        std::memcpy(&v1, w1 + 2 * p, 4);
        std::memcpy(&v2, w2 + 2 * p, 4);
        const __m256i x1 = _mm256_set1_epi32(v1), x2 = _mm256_set1_epi32(v2);
        const __m256i wa = _mm256_load_si256(W + 2 * p), wb = _mm256_load_si256(W + 2 * p + 1);
        a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(wa, x1));
        a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(wb, x1));
        a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(wa, x2));
        a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(wb, x2));
      }
      const size_t os = (size_t)m * nb + b;
      const __m256 s1 = _mm256_set1_ps(a.s1[os]), s2 = _mm256_set1_ps(a.s2[os]);
      const __m256 X = _mm256_set1_ps(a.X[os]);
      float* yr = yp + (size_t)m * 16;
      __m256 v0 = _mm256_mul_ps(d0, _mm256_add_ps(_mm256_mul_ps(s1, _mm256_cvtepi32_ps(a10)),
                                                  _mm256_mul_ps(s2, _mm256_cvtepi32_ps(a20))));
      __m256 v1 = _mm256_mul_ps(d1, _mm256_add_ps(_mm256_mul_ps(s1, _mm256_cvtepi32_ps(a11)),
                                                  _mm256_mul_ps(s2, _mm256_cvtepi32_ps(a21))));
      v0 = _mm256_add_ps(v0, _mm256_mul_ps(m0, X));
      v1 = _mm256_add_ps(v1, _mm256_mul_ps(m1, X));
      _mm256_store_ps(yr, _mm256_add_ps(_mm256_load_ps(yr), v0));
      _mm256_store_ps(yr + 8, _mm256_add_ps(_mm256_load_ps(yr + 8), v1));
    }
  }
  for (int m = 0; m < M; ++m) std::memcpy(y + (size_t)m * ldy, yp + (size_t)m * 16, sizeof(float) * valid);
}

// ------------------------------------------------------------------ AVX2, NK
// A group of 8 columns: per column and block 2 x 16 codes widened to int16, vpmaddwd with the
// row's 32 activations (int16), 8 columns' partial sums reduced together with hadd.
__attribute__((target(T_AVX2))) static void nk_group_avx2(const Act& a, const uint8_t* codes,
                                                          const float* D, const float* Mn,
                                                          float* y, size_t ldy, int valid,
                                                          Avx2Scratch& s) {
  const int M = a.M, nb = a.nb;
  const size_t K = a.K;
  __m256i* W = s.w.get(16);
  float* ds = s.ds.get((size_t)nb * 16);
  float* yp = s.yp.get((size_t)M * 8);
  for (int b = 0; b < nb; ++b)
    for (int c = 0; c < 8; ++c) {
      ds[b * 16 + c] = c < valid ? D[(size_t)c * nb + b] : 0.f;
      ds[b * 16 + 8 + c] = c < valid ? Mn[(size_t)c * nb + b] : 0.f;
    }
  const __m256 nz = _mm256_set1_ps(-0.0f);
  for (int m = 0; m < M; ++m) _mm256_store_ps(yp + 8 * m, nz);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* cb = codes + (size_t)b * kB;
    if (g_pfb > 0 && b + g_pfb < nb && ((b + g_pfb) & 1) == 0)
      for (int c = 0; c < 8; ++c)
        _mm_prefetch((const char*)(cb + (size_t)c * K + (size_t)g_pfb * kB), _MM_HINT_T0);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* r = cb + (size_t)c * K;
      W[2 * c] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)r));
      W[2 * c + 1] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(r + 16)));
    }
    const __m256 d = _mm256_load_ps(ds + b * 16), mn = _mm256_load_ps(ds + b * 16 + 8);
    for (int m = 0; m < M; ++m) {
      const size_t o = (size_t)m * K + (size_t)b * kB, os = (size_t)m * nb + b;
      __m256i I[2];
      for (int l = 0; l < 2; ++l) {
        const int16_t* w = (l == 0 ? a.w1 : a.w2) + o;
        const __m256i xa = _mm256_loadu_si256((const __m256i*)w);
        const __m256i xb = _mm256_loadu_si256((const __m256i*)(w + 16));
        __m256i acc[8];
        for (int c = 0; c < 8; ++c)
          acc[c] = _mm256_add_epi32(_mm256_madd_epi16(W[2 * c], xa), _mm256_madd_epi16(W[2 * c + 1], xb));
        __m256i h01 = _mm256_hadd_epi32(acc[0], acc[1]), h23 = _mm256_hadd_epi32(acc[2], acc[3]);
        __m256i h45 = _mm256_hadd_epi32(acc[4], acc[5]), h67 = _mm256_hadd_epi32(acc[6], acc[7]);
        __m256i g0 = _mm256_hadd_epi32(h01, h23), g1 = _mm256_hadd_epi32(h45, h67);
        I[l] = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                                _mm256_permute2x128_si256(g0, g1, 0x31));
      }
      __m256 t1 = _mm256_mul_ps(_mm256_set1_ps(a.s1[os]), _mm256_cvtepi32_ps(I[0]));
      __m256 t2 = _mm256_mul_ps(_mm256_set1_ps(a.s2[os]), _mm256_cvtepi32_ps(I[1]));
      __m256 v = _mm256_mul_ps(d, _mm256_add_ps(t1, t2));
      __m256 w = _mm256_mul_ps(mn, _mm256_set1_ps(a.X[os]));
      _mm256_store_ps(yp + 8 * m, _mm256_add_ps(_mm256_load_ps(yp + 8 * m), _mm256_add_ps(v, w)));
    }
  }
  for (int m = 0; m < M; ++m) std::memcpy(y + (size_t)m * ldy, yp + (size_t)m * 8, sizeof(float) * valid);
}

// ------------------------------------------------------------------ drivers
struct Scratch {
  KnScratch kn;
  NkScratch nk;
  Avx2Scratch avx2;
  AlignedBuf<uint8_t> pad_codes;
  AlignedBuf<float> pad_scale;
};
thread_local Scratch tl_scratch;

// Tiles are the units split over threads: width 64 (VNNI KN), 16 (AVX2 KN, VNNI NK), 8 (AVX2 NK),
// 16 (scalar: any).
static int tile_width(Isa isa, bool nk) {
  if (isa == kAvx512Vnni) return nk ? 16 : 64;
  if (isa == kAvx2) return nk ? 8 : 16;
  return 16;
}

// columns [n0, n1) (n0 a multiple of the tile width)
static void run_kn(const Act& a, const uint8_t* codes, const float* scale, int N, int n0, int n1,
                   float* y, Isa isa) {
  if (isa == kScalar) return kn_scalar(a, codes, scale, N, n0, n1, y);
  Scratch& s = tl_scratch;
  const int T = tile_width(isa, false);
  const int K = a.K, nb = a.nb;
  const float* D = scale;
  const float* Mn = scale + (size_t)nb * N;
  const int full = (n1 - n0) / T;  // whole tiles
  if (isa == kAvx512Vnni && full > 0) {
    // chunks of C tiles: the chunk's permuted y (M x 64 C floats) within g_ybudget bytes
    const int C = (int)std::max<int64_t>(1, std::min<int64_t>(full, g_ybudget / ((int64_t)a.M * 256)));
    for (int t = 0; t < full; t += C) {
      const int c = std::min(C, full - t);
      const int n = n0 + T * t;
      kn_chunk_vnni(a, codes + n, N, D + n, Mn + n, N, c, y + n, N, T * c, s.kn);
    }
  } else if (full > 0) {
    for (int t = 0; t < full; ++t) {
      const int n = n0 + T * t;
      kn_tile_avx2(a, codes + n, N, D + n, Mn + n, N, y + n, N, T, s.avx2);
    }
  }
  const int n = n0 + T * full, valid = n1 - n;
  if (valid > 0) {  // the last, partial tile: a zero-padded copy, the same code
    uint8_t* pc = s.pad_codes.get((size_t)K * T);
    float* ps = s.pad_scale.get((size_t)2 * nb * T);
    for (int k = 0; k < K; ++k) {
      std::memset(pc + (size_t)k * T, 0, T);
      std::memcpy(pc + (size_t)k * T, codes + (size_t)k * N + n, valid);
    }
    for (int b = 0; b < 2 * nb; ++b) {
      std::memset(ps + (size_t)b * T, 0, sizeof(float) * T);
      std::memcpy(ps + (size_t)b * T, scale + (size_t)b * N + n, sizeof(float) * valid);
    }
    if (isa == kAvx512Vnni)
      kn_chunk_vnni(a, pc, T, ps, ps + (size_t)nb * T, T, 1, y + n, N, valid, s.kn);
    else
      kn_tile_avx2(a, pc, T, ps, ps + (size_t)nb * T, T, y + n, N, valid, s.avx2);
  }
}

static void run_nk(const Act& a, const uint8_t* codes, const float* scale, int N, int n0, int n1,
                   float* y, Isa isa) {
  if (isa == kScalar) return nk_scalar(a, codes, scale, N, n0, n1, y);
  Scratch& s = tl_scratch;
  const int T = tile_width(isa, true);
  const int K = a.K, nb = a.nb;
  const float* D = scale;
  const float* Mn = scale + (size_t)N * nb;
  for (int n = n0; n < n1; n += T) {
    const int valid = std::min(T, n1 - n);
    const uint8_t* c = codes + (size_t)n * K;
    if (valid < T) {  // zero-padded rows of codes (d, m of the missing columns are read as 0)
      uint8_t* pc = s.pad_codes.get((size_t)K * T);
      std::memset(pc, 0, (size_t)K * T);
      std::memcpy(pc, c, (size_t)K * valid);
      c = pc;
    }
    if (isa == kAvx512Vnni)
      nk_group_vnni(a, c, D + (size_t)n * nb, Mn + (size_t)n * nb, y + n, N, valid,
                    g_pfg > 0 && n + T * (g_pfg + 1) <= n1 ? codes + (size_t)(n + T * g_pfg) * K : nullptr,
                    s.nk);
    else
      nk_group_avx2(a, c, D + (size_t)n * nb, Mn + (size_t)n * nb, y + n, N, valid, s.avx2);
  }
}

struct ActStore {
  AlignedBuf<int8_t> q;
  AlignedBuf<int16_t> w;
  AlignedBuf<float> f;
};
thread_local ActStore tl_act;

static void prepare(const float* x, int M, int K, Act& a, Isa isa) {
  a.M = M, a.K = K, a.nb = K / kB;
  const size_t n = (size_t)M * K, ns = (size_t)M * a.nb;
  int8_t* q = tl_act.q.get(2 * n + 64);
  a.q1 = q, a.q2 = q + n;
  if (isa == kAvx2) {
    int16_t* w = tl_act.w.get(2 * n + 32);
    a.w1 = w, a.w2 = w + n;
  }
  float* f = tl_act.f.get(3 * ns + 16);
  a.s1 = f, a.s2 = f + ns, a.X = f + 2 * ns;
  quantize(x, a, isa);
}

static ffi::Error impl(bool nk, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                       ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                       int64_t threads) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("q8block: x [M,K], codes 2-D, scale 3-D, y [M,N] expected");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (yd[0] != M) return ffi::Error::InvalidArgument("q8block: y rows != x rows");
  if (K % kB) return ffi::Error::InvalidArgument("q8block: K must be a multiple of 32");
  const int64_t nb = K / kB;
  const bool ok = nk ? (cd[0] == N && cd[1] == K && sd[0] == 2 && sd[1] == N && sd[2] == nb)
                     : (cd[0] == K && cd[1] == N && sd[0] == 2 && sd[1] == nb && sd[2] == N);
  if (!ok) return ffi::Error::InvalidArgument("q8block: codes / scale shapes do not match x and y");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const Isa isa = g_isa;
  Act a;
  prepare(x.typed_data(), (int)M, (int)K, a, isa);
  const uint8_t* c = codes.typed_data();
  const float* s = scale.typed_data();
  float* out = y->typed_data();
  auto run = [&](int n0, int n1) {
    if (nk)
      run_nk(a, c, s, (int)N, n0, n1, out, isa);
    else
      run_kn(a, c, s, (int)N, n0, n1, out, isa);
  };
  const int T = tile_width(isa, nk);
  const int64_t ntiles = (N + T - 1) / T;
  const int64_t want = M >= g_min_par_rows ? threads : 1;
  const int nthr = (int)std::max<int64_t>(1, std::min<int64_t>(want, ntiles));
  if (nthr == 1) {
    run(0, (int)N);
    return ffi::Error::Success();
  }
  // contiguous ranges of whole tiles; each thread has its own scratch, writes its own columns
  auto bound = [&](int i) { return (int)std::min<int64_t>(N, (ntiles * i / nthr) * T); };
  const std::function<void(int)> part = [&](int i) { run(bound(i), bound(i + 1)); };
  if (!pool().run(nthr, part)) run(0, (int)N);  // the pool is busy: this thread does it all
  return ffi::Error::Success();
}

ffi::Error ImplKN(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  return impl(false, x, codes, scale, y, threads);
}
ffi::Error ImplNK(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  return impl(true, x, codes, scale, y, threads);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8BlockKN, ImplKN,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8BlockNK, ImplNK,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

// The path in use: 0 scalar, 1 AVX2, 2 AVX-512 VNNI. q8block_set_isa(i) uses min(i, the best the
// CPU has) from now on (tests run every path in one process) and returns what it set.
extern "C" int q8block_isa() { return (int)g_isa; }
extern "C" int q8block_best_isa() { return (int)g_best; }
extern "C" int q8block_set_isa(int isa) {
  g_isa = (Isa)std::max(0, std::min(isa, (int)g_best));
  return (int)g_isa;
}
