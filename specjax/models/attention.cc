// specjax's attention over the KV cache on CPU (XLA FFI custom call). Built on first use by
// specjax/models/cpu_attention.py (specjax/models/kernels.py: g++ -O3 -shared -fPIC -std=c++17
// -ffp-contract=off).
//
// One handler, Attention:
//   q       f32 [B, T, H, hd]   the queries (RoPE applied)
//   k, v    f32 [B, KV, S, hd]  the cache (this call's K/V already written)
//   lo      i32 [B, T]          the first visible logical key of query t (a sliding window; else 0)
//   prefix  i32 [B, T]          logical keys 0 .. prefix-1 are the slots 0 .. prefix-1
//   extra   i32 [B, T, E]       logical key prefix + j is the slot extra[j] (a tree node's ancestors,
//   n_extra i32 [B, T]          root first, itself last), for j < n_extra
//   attributes: scale (f32, the score scale), softcap (f32, 0: none), threads (i64)
//   -> out  f32 [B, T, H, hd]
// Query head h reads KV head h / (H / KV) (grouped-query attention). A causal query at position p
// has prefix = p + 1, n_extra = 0; a tree node at depth d below the root slot r has prefix = r and
// its path's d + 1 slots in extra: its logical keys are then exactly those of the causal query at
// position r + d over that path, in the same order.
//
// The arithmetic of one query over its visible logical keys i = lo .. n-1 (n = prefix + n_extra):
//   s_i = (q . k_i) * scale, the dot as 16 lane sums over d (lane d % 16, in increasing d: the first
//         product, then one fused multiply-add per later product), then the halving tree of the
//         lanes (l + 8, + 4, + 2, + 1); softcap: s_i = tanh(s_i / c) * c;
//   m = max s_i;  e_i = exp(s_i - m) (exp_ below: one fixed polynomial);
//   den = 16 lane sums of e_i (lane (i - lo) % 16, in increasing i), then the halving tree;
//   out[d] = (e_i * v_i[d] summed by fused multiply-adds in increasing i from 0) / den.
// Every other operation is rounded to float32 on its own (no contraction: -ffp-contract=off; the
// fused multiply-adds are written out, one rounding each on every path) and the order is a
// function of the query's own logical keys only: so the result does not depend on B, T, S, the
// other rows or queries, how the queries are grouped, the threads, or the instruction set (the
// AVX-512 path and the generic one, compiled for x86-64-v4/v3/baseline, do the same IEEE
// operations per element). Hence a (γ+1)-token verify call, a one-token decode step, a tree call
// and a prefill chunk give the same bits for the same query and keys: the batch-invariance
// property of docs/design.md by construction.
// A query with no visible key (a padded row) gets zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

#include "cpu_pool.h"

namespace ffi = xla::ffi;

namespace {

using specjax_cpu::AlignedBuf;
using specjax_cpu::env_int;
using specjax_cpu::pool;

constexpr int kL = 16;   // lanes of the dot and of the normalizer
constexpr int kTG = 4;   // causal queries (positions of one row) that share a pass over the keys
// threads > 1 only for calls of at least this many multiply-adds (prefill chunks, long caches)
static const int64_t g_min_par_work = env_int("SPECJAX_ATTN_MIN_PAR_WORK", 1 << 23);

// run_item is compiled for AVX-512, AVX2 and plain x86-64 (the loader picks one); the helpers are
// inlined into each
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define INL inline __attribute__((always_inline))

// exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, ln2 in
// two parts), exp(r) by its degree-6 Taylor polynomial in Horner form, times 2^n by the exponent
// bits; 0 below -87.3 (2^-126). Relative error < 2e-7. The same operations in every lane.
INL static float exp_(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float t = x * 1.44269504f + 12582912.0f;  // rint(x / ln2) + 1.5 * 2^23
  const float n = t - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e;
  std::memcpy(&e, &t, 4);
  e = (e - 0x4B400000 + 127) << 23;  // the integer n (from t's mantissa) + the bias, as exponent bits
  float s;
  std::memcpy(&s, &e, 4);
  return p * s;
}

INL static float lane_tree(float* a) {  // the halving tree of kL lanes (a is overwritten)
  for (int w = kL / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
  return a[0];
}

INL static float dot_(const float* q, const float* k, int hd) {
  float a[kL] = {0};
  for (int l = 0; l < std::min(kL, hd); ++l) a[l] = q[l] * k[l];
  for (int d0 = kL; d0 < hd; d0 += kL) {
    const int w = std::min(kL, hd - d0);
    for (int l = 0; l < w; ++l) a[l] = __builtin_fmaf(q[d0 + l], k[d0 + l], a[l]);
  }
  return lane_tree(a);
}

INL static void exp_row(float* s, int lo, int n, float m) {
  for (int i = lo; i < n; ++i) s[i] = exp_(s[i] - m);
}

INL static float row_sum(const float* e, int lo, int n) {
  float a[kL] = {0};
  for (int i = lo; i < n; ++i) a[(i - lo) % kL] = a[(i - lo) % kL] + e[i];
  return lane_tree(a);
}

INL static void axpy_(float* acc, float e, const float* v, int hd) {
  for (int d = 0; d < hd; ++d) acc[d] = __builtin_fmaf(e, v[d], acc[d]);
}

struct Call {
  const float *q, *k, *v;
  const int32_t *lo, *prefix, *extra, *n_extra;
  float* out;
  int64_t B, T, H, hd, KV, S, E;
  float scale, softcap;
};

// The keys of one query: logical key i is slot i below `prefix`, else slot extra[i - prefix].
struct Keys {
  const float *k, *v;  // this row's KV head: [S, hd]
  const int32_t* extra;
  int64_t prefix, hd;
  INL const float* krow(int64_t i) const { return k + (i < prefix ? i : extra[i - prefix]) * hd; }
  INL const float* vrow(int64_t i) const { return v + (i < prefix ? i : extra[i - prefix]) * hd; }
};

// ---- the generic path (any hd; auto-vectorized where the compiler can)
CLONES static void scores_generic(const Keys& K, const float* q, int lo, int n, float scale, float* s) {
  for (int i = lo; i < n; ++i) s[i] = dot_(q, K.krow(i), (int)K.hd) * scale;
}

CLONES static float softmax_generic(float* s, int lo, int n) {  // e_i in place; returns the normalizer
  float m = s[lo];
  for (int i = lo + 1; i < n; ++i) m = s[i] > m ? s[i] : m;
  exp_row(s, lo, n, m);
  return row_sum(s, lo, n);
}

CLONES static void values_generic(const Keys& K, const float* e, int lo, int n, float den, float* out) {
  const int hd = (int)K.hd;
  float acc[256];
  for (int d = 0; d < hd; ++d) acc[d] = 0.f;
  for (int i = lo; i < n; ++i) axpy_(acc, e[i], K.vrow(i), hd);
  for (int d = 0; d < hd; ++d) out[d] = acc[d] / den;
}

// ---- the AVX-512 path (hd a multiple of 16, at most 256): the same operations per element
#define T512 __attribute__((target("avx512f,avx512dq,fma")))

// 16 keys' lane vectors a[0..15] -> their 16 halving-tree sums, in key order: each level adds the
// upper half of every key's remaining lanes to its lower half, two vectors packed into one.
T512 static inline __m512 tree16(__m512* a) {
  alignas(64) static const int32_t i1l[16] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  alignas(64) static const int32_t i1h[16] = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  alignas(64) static const int32_t i2l[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  alignas(64) static const int32_t i2h[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  alignas(64) static const int32_t i3l[16] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  alignas(64) static const int32_t i3h[16] = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  alignas(64) static const int32_t i4l[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t i4h[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i l1 = _mm512_load_si512(i1l), h1 = _mm512_load_si512(i1h);
  const __m512i l2 = _mm512_load_si512(i2l), h2 = _mm512_load_si512(i2h);
  const __m512i l3 = _mm512_load_si512(i3l), h3 = _mm512_load_si512(i3h);
  const __m512i l4 = _mm512_load_si512(i4l), h4 = _mm512_load_si512(i4h);
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)
    b[m] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * m], l1, a[2 * m + 1]),
                         _mm512_permutex2var_ps(a[2 * m], h1, a[2 * m + 1]));
  for (int m = 0; m < 4; ++m)
    c[m] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * m], l2, b[2 * m + 1]),
                         _mm512_permutex2var_ps(b[2 * m], h2, b[2 * m + 1]));
  for (int m = 0; m < 2; ++m)
    d[m] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * m], l3, c[2 * m + 1]),
                         _mm512_permutex2var_ps(c[2 * m], h3, c[2 * m + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(d[0], l4, d[1]), _mm512_permutex2var_ps(d[0], h4, d[1]));
}

T512 static inline __m512 lanes512(const __m512* qv, int nc, const float* kr) {
  __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
  for (int c = 1; c < nc; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
  return a;
}

T512 static inline __m512 exp512(__m512 x) {  // exp_ in every lane
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), big);
  const __m512 n = _mm512_sub_ps(t, big);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.38888889e-3f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.33333333e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.16666667e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.66666667e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  __m512i e = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000 - 127));
  e = _mm512_slli_epi32(e, 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

T512 static float softmax_avx512(float* s, int lo, int n) {
  const int len = n - lo;
  float* x = s + lo;
  __m512 mv = _mm512_set1_ps(x[0]);
  int i = 0;
  for (; i + 16 <= len; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  if (i < len) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, (__mmask16)((1u << (len - i)) - 1), x + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 acc = _mm512_setzero_ps();
  for (i = 0; i + 16 <= len; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < len) {
    const __mmask16 k = (__mmask16)((1u << (len - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, acc);
  return lane_tree(t);
}

static bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}
// SPECJAX_ATTN_GENERIC=1: the generic path everywhere (tests: both paths give the same bits)
static const bool g_avx512 = has_avx512() && env_int("SPECJAX_ATTN_GENERIC", 0) == 0;

struct Qj {  // one query of a work item
  const float* q;
  float* out;
  float* s;  // its scores, then e_i, at s[lo .. n-1]
  float* acc;  // [hd] its value sums between key chunks
  int lo, n;
  float den;
};

// acc_j += e_j[i] * v_i for the NQ queries qs[0..NQ-1], keys i in [i0, i1) inside each query's range,
// dims 16 * c0 .. 16 * (c0 + W) - 1: the accumulators stay in registers over the chunk of keys.
template <int NQ, int W>
T512 static void values_chunk(const Keys& K, Qj* qs, int i0, int i1, int c0) {
  __m512 a[NQ][W];
#pragma GCC unroll 4
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) a[j][w] = _mm512_loadu_ps(qs[j].acc + 16 * (c0 + w));
  for (int i = i0; i < i1; ++i) {
    const float* vr = K.vrow(i) + 16 * c0;
    __m512 v[W];
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) v[w] = _mm512_loadu_ps(vr + 16 * w);
#pragma GCC unroll 4
    for (int j = 0; j < NQ; ++j) {
      if (i < qs[j].lo || i >= qs[j].n) continue;
      const __m512 e = _mm512_set1_ps(qs[j].s[i]);
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) a[j][w] = _mm512_fmadd_ps(e, v[w], a[j][w]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(qs[j].acc + 16 * (c0 + w), a[j][w]);
}

template <int NQ>
T512 static void values_chunk_w(const Keys& K, Qj* qs, int i0, int i1, int nc) {
  for (int c0 = 0; c0 < nc; c0 += 4) {
    switch (std::min(4, nc - c0)) {
      case 4: values_chunk<NQ, 4>(K, qs, i0, i1, c0); break;
      case 3: values_chunk<NQ, 3>(K, qs, i0, i1, c0); break;
      case 2: values_chunk<NQ, 2>(K, qs, i0, i1, c0); break;
      default: values_chunk<NQ, 1>(K, qs, i0, i1, c0); break;
    }
  }
}

thread_local AlignedBuf<float> tl_scores;
thread_local AlignedBuf<float> tl_acc;

// A work item on the AVX-512 path: every query of the item in one pass over its keys (each key and
// value row read once per item, not once per query); the same operations per query as the generic
// path (the order of a query's own sums does not depend on the other queries).
T512 static void item_avx512(const Call& c, const Keys& K, Qj* qs, int nq) {
  const int nc = (int)K.hd / 16;
  int lo_min = qs[0].lo, n_max = qs[0].n;
  for (int j = 1; j < nq; ++j) lo_min = std::min(lo_min, qs[j].lo), n_max = std::max(n_max, qs[j].n);
  const __m512 sc = _mm512_set1_ps(c.scale);
  __m512 a[16], qv[16];
  alignas(64) float t[16];
  for (int i0 = lo_min; i0 < n_max; i0 += 16) {  // scores, 16 keys at a time
    const int i1 = std::min(i0 + 16, n_max);
    for (int j = 0; j < nq; ++j) {
      const int x = std::max(i0, qs[j].lo), z = std::min(i1, qs[j].n);
      if (x >= z) continue;
      for (int cc = 0; cc < nc; ++cc) qv[cc] = _mm512_loadu_ps(qs[j].q + 16 * cc);
      if (x == i0 && z == i0 + 16) {
        for (int kk = 0; kk < 16; ++kk) a[kk] = lanes512(qv, nc, K.krow(i0 + kk));
        _mm512_storeu_ps(qs[j].s + i0, _mm512_mul_ps(tree16(a), sc));
      } else {
        for (int i = x; i < z; ++i) {
          _mm512_store_ps(t, lanes512(qv, nc, K.krow(i)));
          qs[j].s[i] = lane_tree(t) * c.scale;
        }
      }
    }
  }
  for (int j = 0; j < nq; ++j) {
    float* s = qs[j].s;
    if (c.softcap > 0.f)
      for (int i = qs[j].lo; i < qs[j].n; ++i) s[i] = std::tanh(s[i] / c.softcap) * c.softcap;
    qs[j].den = softmax_avx512(s, qs[j].lo, qs[j].n);
    std::memset(qs[j].acc, 0, sizeof(float) * K.hd);
  }
  constexpr int kChunk = 64;  // keys per chunk: their value rows stay in L1 across the sub-groups
  for (int i0 = lo_min; i0 < n_max; i0 += kChunk) {
    const int i1 = std::min(i0 + kChunk, n_max);
    for (int j0 = 0; j0 < nq; j0 += 3) {
      switch (std::min(3, nq - j0)) {
        case 3: values_chunk_w<3>(K, qs + j0, i0, i1, nc); break;
        case 2: values_chunk_w<2>(K, qs + j0, i0, i1, nc); break;
        default: values_chunk_w<1>(K, qs + j0, i0, i1, nc); break;
      }
    }
  }
  for (int j = 0; j < nq; ++j) {
    const __m512 dv = _mm512_set1_ps(qs[j].den);
    for (int cc = 0; cc < nc; ++cc)
      _mm512_storeu_ps(qs[j].out + 16 * cc, _mm512_div_ps(_mm512_loadu_ps(qs[j].acc + 16 * cc), dv));
  }
}

// One work item: query heads g0 .. g0 + ng - 1 of KV head kvh, row b, positions t0 .. t0 + nt - 1
// (nt > 1 only for causal ones).
static void run_item(const Call& c, int64_t b, int64_t kvh, int64_t t0, int64_t nt, int64_t g0, int64_t ng) {
  const int64_t G = c.H / c.KV, hd = c.hd;
  const bool fast = g_avx512 && hd % 16 == 0 && hd <= 256;
  const int64_t nq = nt * ng;
  float* sc = tl_scores.get(nq * c.S + 16);
  float* accb = tl_acc.get(nq * hd);
  Qj qs[kTG * 64];
  Keys K;
  K.k = c.k + (b * c.KV + kvh) * c.S * hd;
  K.v = c.v + (b * c.KV + kvh) * c.S * hd;
  K.hd = hd;
  const int64_t bt0 = b * c.T + t0;
  const int64_t ne0 = c.n_extra[bt0] <= 0 ? 0 : std::min<int64_t>(c.n_extra[bt0], c.E);
  K.extra = c.extra + bt0 * c.E;
  K.prefix = ne0 ? std::clamp<int64_t>(c.prefix[bt0], 0, c.S - ne0) : c.S;  // causal: slot i = key i
  int m = 0;
  for (int64_t tt = 0; tt < nt; ++tt) {
    const int64_t bt = bt0 + tt;
    const int n = (int)(ne0 ? K.prefix + ne0 : std::clamp<int64_t>(c.prefix[bt], 0, c.S));
    const int lo = (int)std::clamp<int64_t>(c.lo[bt], 0, n);
    for (int64_t g = g0; g < g0 + ng; ++g) {
      const int64_t h = kvh * G + g;
      float* out = c.out + (bt * c.H + h) * hd;
      if (lo >= n) {
        std::memset(out, 0, sizeof(float) * hd);
        continue;
      }
      qs[m] = Qj{c.q + (bt * c.H + h) * hd, out, sc + m * c.S, accb + m * hd, lo, n, 0.f};
      ++m;
    }
  }
  if (m == 0) return;
  if (fast) {
    item_avx512(c, K, qs, m);
    return;
  }
  for (int j = 0; j < m; ++j) {
    const Qj& Q = qs[j];
    scores_generic(K, Q.q, Q.lo, Q.n, c.scale, Q.s);
    if (c.softcap > 0.f)
      for (int i = Q.lo; i < Q.n; ++i) Q.s[i] = std::tanh(Q.s[i] / c.softcap) * c.softcap;
    values_generic(K, Q.s, Q.lo, Q.n, softmax_generic(Q.s, Q.lo, Q.n), Q.out);
  }
}

struct Item {
  int64_t b, kvh, t0, nt, g0, ng;  // query heads kvh * G + g0 .. + ng - 1
};
thread_local AlignedBuf<Item> tl_items;

ffi::Error Impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> prefix, ffi::Buffer<ffi::S32> extra,
                ffi::Buffer<ffi::S32> n_extra, ffi::ResultBuffer<ffi::F32> out, float scale, float softcap,
                int64_t threads) {
  auto qd = q.dimensions(), kd = k.dimensions(), ed = extra.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || ed.size() != 3)
    return ffi::Error::InvalidArgument("attention: q [B,T,H,hd], k/v [B,KV,S,hd], extra [B,T,E] expected");
  Call c;
  c.B = qd[0], c.T = qd[1], c.H = qd[2], c.hd = qd[3], c.KV = kd[1], c.S = kd[2], c.E = ed[2];
  if (kd[0] != c.B || kd[3] != c.hd || c.KV <= 0 || c.H % c.KV || (c.H / c.KV) > 64 || ed[0] != c.B ||
      ed[1] != c.T || v.dimensions().size() != 4 || v.dimensions()[2] != c.S)
    return ffi::Error::InvalidArgument("attention: shapes of q, k, v, extra do not match");
  if (c.hd > 256) return ffi::Error::InvalidArgument("attention: head_dim > 256");
  c.q = q.typed_data(), c.k = k.typed_data(), c.v = v.typed_data();
  c.lo = lo.typed_data(), c.prefix = prefix.typed_data(), c.extra = extra.typed_data();
  c.n_extra = n_extra.typed_data(), c.out = out->typed_data();
  c.scale = scale, c.softcap = softcap;
  if (c.B == 0 || c.T == 0 || c.H == 0) return ffi::Error::Success();
  // work items: per (row, KV head), runs of <= kTG causal positions, tree nodes one by one
  const int64_t G = c.H / c.KV;
  Item* items = tl_items.get(c.B * c.KV * c.T);
  int64_t ni = 0, work = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.T;) {
      int64_t nt = 1;
      if (c.n_extra[b * c.T + t] <= 0)
        while (nt < kTG && t + nt < c.T && c.n_extra[b * c.T + t + nt] <= 0) ++nt;
      for (int64_t kvh = 0; kvh < c.KV; ++kvh) items[ni++] = Item{b, kvh, t, nt, 0, G};
      for (int64_t tt = t; tt < t + nt; ++tt)
        work += int64_t(std::max(0, c.prefix[b * c.T + tt])) * c.H * c.hd * 2;
      t += nt;
    }
  }
  // rows of items in order of (b, t, kvh); each thread takes a contiguous range
  auto part_run = [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) {
      const Item& it = items[i];
      run_item(c, it.b, it.kvh, it.t0, it.nt, it.g0, it.ng);
    }
  };
  int64_t nthr = (work >= g_min_par_work) ? std::max<int64_t>(threads, 1) : 1;
  nthr = std::min(nthr, ni);
  if (nthr <= 1) {
    part_run(0, ni);
    return ffi::Error::Success();
  }
  auto part = [&](int p) { part_run(ni * p / nthr, ni * (p + 1) / nthr); };
  if (!pool().run((int)nthr, part)) part_run(0, ni);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Attention, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("threads"));
