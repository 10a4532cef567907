// Q8_0 x Q8_0 CPU matmul for JAX via the XLA FFI (prototype).
//
// y[m, n] = sum_b (xs[m,b] * ws[b,n]) * float(sum_{k in b} xq[m,k] * wq[k,n])
//   blocks b of 32 consecutive k, float sum over b in increasing order,
//   integer block sums exact in int32; float ops are plain mul/mul/add
//   (compiled with -ffp-contract=off, so no FMA contraction) => bitwise
//   identical to the numpy reference and to every ISA path, and independent of
//   M / of the other rows / of the thread split (threads split only N).
//
// Packed weight layout (see pack_weights in q8.py):
//   wp[N/32][K/4][32][4]  uint8  = wq + 128      (tile of 32 output columns
//                                                contiguous over all K)
//   sp[N/32][K/32][32]    float32 = ws[b, n]
// The +128 offset makes the weights the unsigned operand of vpdpbusd; the
// error term 128 * sum_{k in b} xq[m,k] is removed per (row, block) exactly.
//
// Handlers: Q8MatmulST (single thread), Q8MatmulMT (XLA intra-op thread pool).
// Operands: x f32[..., K], wp u8[any shape, N*K elems], sp f32[any, N*K/32]
// Result:   y f32[..., N]

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 32;   // output columns per tile
constexpr int kBlock = 32;  // inputs per quantization block

static int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : dflt;
}
// Software prefetch distance in bytes ahead in the weight stream (0 = off).
static const int g_pf = env_int("Q8_PF", 8192);
static const int g_half_tiles = env_int("Q8_HALF_TILES", 0);

// Quantized activations, M rows.
struct QAct {
  int M = 0, K = 0, nb = 0;
  int8_t* xq = nullptr;     // [M][K]
  float* xs = nullptr;      // [M][nb]
  int32_t* xc = nullptr;    // [M][nb]  128 * sum_k xq in block
  std::vector<uint8_t> storage;
  void resize(int M_, int K_) {
    M = M_; K = K_; nb = K_ / kBlock;
    size_t n1 = (size_t)M * K, n2 = (size_t)M * nb * 4;
    size_t need = n1 + 2 * n2 + 64;
    if (storage.size() < need) storage.resize(need);
    uint8_t* p = storage.data();
    xq = (int8_t*)p;
    xs = (float*)(p + ((n1 + 15) & ~size_t(15)));
    xc = (int32_t*)((uint8_t*)xs + n2);
  }
};

// ---------------------------------------------------------------- quantize
// Per block: amax = max|x|, xs = amax / 127 (xs = 1 if amax == 0),
// xq = round_half_even(x / xs) (true division), clamped to [-127, 127].
static void quant_block_scalar(const float* x, int8_t* q, float* xs,
                               int32_t* xc) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  float s = amax / 127.0f;
  if (amax == 0.f) s = 1.0f;
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    float v = std::nearbyint(x[i] / s);
    v = std::min(127.f, std::max(-127.f, v));
    q[i] = (int8_t)v;
    sum += q[i];
  }
  *xs = s;
  *xc = 128 * sum;
}

__attribute__((target("avx2"))) static void quant_block_avx2(
    const float* x, int8_t* q, float* xs, int32_t* xc) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float amax = _mm_cvtss_f32(m4);
  float s = amax / 127.0f;
  if (amax == 0.f) s = 1.0f;
  __m256 sv = _mm256_set1_ps(s);
  __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i qi[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));  // MXCSR: nearest-even
    qi[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, qi[i]));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
  __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
  __m256i p = _mm256_packs_epi16(p01, p23);
  // lanes now: [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, q1 4-7, ...]
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, p);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum),
                             _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *xs = s;
  *xc = 128 * _mm_cvtsi128_si32(s4);
}

// ---------------------------------------------------------------- kernels
// One tile (32 output columns) x a group of R rows, T 16-column vectors
// starting at column col0 (T=2: whole tile; T=1: half tile, col0 = 0 or 16).
//   wt: tile weights [K/4][32][4] u8; st: tile scales [nb][32]
//   xq: row 0 of the group (row stride K); xs, xc: row stride nb
//   y:  output row 0 of the group at the tile's column 0, row stride ldy
// The integer block sum may use several accumulator sets (exact); the float
// part is the same mul, mul, add sequence per element for every R/T.
template <int R, int T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void
tile_avx512vnni(const uint8_t* __restrict wt, const float* __restrict st,
                int col0, const int8_t* __restrict xq,
                const float* __restrict xs, const int32_t* __restrict xc,
                int K, int nb, float* __restrict y, int ldy, int pf,
                int pf_phase, int pf_step) {
  constexpr int S = (R * T < 4) ? 2 : 1;  // accumulator sets (latency hiding)
  __m512 f[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* wb = wt + (size_t)b * (kBlock * kTile);
    if (pf > 0) {
      // T=2: the pf_step passes over this tile share the prefetching of the
      // stream ahead (line i in pass i % pf_step), so requests keep flowing
      // during every pass. T=1: each half-tile pass prefetches its lines.
      if (T == 2) {
        for (int i = pf_phase; i < 16; i += pf_step)
          _mm_prefetch((const char*)(wb + pf + 64 * i), _MM_HINT_T0);
      } else {
        for (int i = col0 / 16; i < 16; i += 2)
          _mm_prefetch((const char*)(wb + pf + 64 * i), _MM_HINT_T0);
      }
    }
    __m512i a[S][R][T];
    for (int u = 0; u < S; ++u)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) a[u][r][t] = _mm512_setzero_si512();
    const uint8_t* wc = wb + 4 * col0;
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      const int u = q % S;
      __m512i w[T];
      for (int t = 0; t < T; ++t) w[t] = _mm512_loadu_si512(wc + q * 128 + 64 * t);
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, xq + (size_t)r * K + b * kBlock + 4 * q, 4);
        __m512i v = _mm512_set1_epi32(xv);
        for (int t = 0; t < T; ++t) a[u][r][t] = _mm512_dpbusd_epi32(a[u][r][t], w[t], v);
      }
    }
    if (S == 2)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) a[0][r][t] = _mm512_add_epi32(a[0][r][t], a[S - 1][r][t]);
    __m512 sc[T];
    for (int t = 0; t < T; ++t) sc[t] = _mm512_loadu_ps(st + b * kTile + col0 + 16 * t);
    for (int r = 0; r < R; ++r) {
      __m512i c = _mm512_set1_epi32(xc[r * nb + b]);
      __m512 d = _mm512_set1_ps(xs[r * nb + b]);
      for (int t = 0; t < T; ++t) {
        __m512 tt = _mm512_mul_ps(_mm512_mul_ps(d, sc[t]),
                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(a[0][r][t], c)));
        f[r][t] = _mm512_add_ps(f[r][t], tt);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(y + (size_t)r * ldy + col0 + 16 * t, f[r][t]);
}

typedef void (*TileFn)(const uint8_t*, const float*, int, const int8_t*,
                       const float*, const int32_t*, int, int, float*, int, int,
                       int, int);
// for T=2 (R<=4) and T=1 (R<=8)
static const TileFn kTileT2[4] = {
    tile_avx512vnni<1, 2>, tile_avx512vnni<2, 2>, tile_avx512vnni<3, 2>,
    tile_avx512vnni<4, 2>};
static const TileFn kTileT1[8] = {
    tile_avx512vnni<1, 1>, tile_avx512vnni<2, 1>, tile_avx512vnni<3, 1>,
    tile_avx512vnni<4, 1>, tile_avx512vnni<5, 1>, tile_avx512vnni<6, 1>,
    tile_avx512vnni<7, 1>, tile_avx512vnni<8, 1>};

// AVX2 (no VNNI): u8 -> i16 widening + vpmaddwd, one row at a time.
// acc[j] holds columns 4j..4j+3 as pairs of partial sums (k01, k23).
__attribute__((target("avx2"))) static void tile_avx2_row(
    const uint8_t* __restrict wt, const float* __restrict st,
    const int8_t* __restrict xq, const float* __restrict xs,
    const int32_t* __restrict xc, int nb, float* __restrict y, int pf) {
  __m256 f[4];
  for (int j = 0; j < 4; ++j) f[j] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* wb = wt + (size_t)b * (kBlock * kTile);
    if (pf > 0)
      for (int i = 0; i < kBlock * kTile; i += 64)
        _mm_prefetch((const char*)(wb + pf + i), _MM_HINT_T0);
    __m256i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
    for (int q = 0; q < 8; ++q) {
      int32_t xv;
      std::memcpy(&xv, xq + b * kBlock + 4 * q, 4);
      __m256i v = _mm256_cvtepi8_epi16(_mm_set1_epi32(xv));
      for (int j = 0; j < 8; ++j) {
        __m256i w = _mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i*)(wb + q * 128 + 16 * j)));
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(w, v));
      }
    }
    __m256i c = _mm256_set1_epi32(xc[b]);
    __m256 d = _mm256_set1_ps(xs[b]);
    for (int h = 0; h < 4; ++h) {
      __m256i s = _mm256_hadd_epi32(acc[2 * h], acc[2 * h + 1]);
      s = _mm256_permute4x64_epi64(s, _MM_SHUFFLE(3, 1, 2, 0));
      __m256 sc = _mm256_loadu_ps(st + b * kTile + 8 * h);
      __m256 t = _mm256_mul_ps(_mm256_mul_ps(d, sc),
                               _mm256_cvtepi32_ps(_mm256_sub_epi32(s, c)));
      f[h] = _mm256_add_ps(f[h], t);
    }
  }
  for (int h = 0; h < 4; ++h) _mm256_storeu_ps(y + 8 * h, f[h]);
}

static void tile_scalar_row(const uint8_t* wt, const float* st,
                            const int8_t* xq, const float* xs,
                            const int32_t* xc, int nb, float* y) {
  float f[kTile] = {0};
  for (int b = 0; b < nb; ++b) {
    const uint8_t* wb = wt + (size_t)b * (kBlock * kTile);
    for (int n = 0; n < kTile; ++n) {
      int32_t acc = 0;
      for (int q = 0; q < 8; ++q)
        for (int i = 0; i < 4; ++i)
          acc += (int32_t)wb[q * 128 + n * 4 + i] * xq[b * kBlock + 4 * q + i];
      float d = xs[b] * st[b * kTile + n];
      float t = d * (float)(acc - xc[b]);
      f[n] = f[n] + t;
    }
  }
  for (int n = 0; n < kTile; ++n) y[n] = f[n];
}

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

static Isa detect_isa() {
  const char* force = std::getenv("Q8_FORCE_ISA");
  Isa best = kScalar;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) best = kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    best = kAvx512Vnni;
  if (force) {
    Isa f = (Isa)std::atoi(force);
    if (f < best) best = f;
  }
  return best;
}

static const Isa g_isa = detect_isa();

static void quantize(const float* x, QAct& q) {
  for (int m = 0; m < q.M; ++m)
    for (int b = 0; b < q.nb; ++b) {
      const float* xb = x + (size_t)m * q.K + b * kBlock;
      int8_t* qb = q.xq + (size_t)m * q.K + b * kBlock;
      float* s = q.xs + m * q.nb + b;
      int32_t* c = q.xc + m * q.nb + b;
      if (g_isa >= kAvx2)
        quant_block_avx2(xb, qb, s, c);
      else
        quant_block_scalar(xb, qb, s, c);
    }
}

// Compute tiles [t0, t1) for all rows.
static void compute_tiles(const QAct& q, const uint8_t* wp, const float* sp,
                          int N, int t0, int t1, float* y) {
  const int K = q.K, nb = q.nb;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* wt = wp + (size_t)t * K * kTile;
    const float* st = sp + (size_t)t * nb * kTile;
    float* yt = y + (size_t)t * kTile;
    if (g_isa == kAvx512Vnni) {
      if (g_half_tiles && q.M > 4) {
        // Experimental: rows in chunks of <= 8, two half-tile passes (T=1).
        for (int m0 = 0; m0 < q.M; m0 += 8) {
          int R = std::min(8, q.M - m0);
          const int pf = m0 == 0 ? g_pf : 0;
          float* ym = yt + (size_t)m0 * N;
          kTileT1[R - 1](wt, st, 0, q.xq + (size_t)m0 * K, q.xs + m0 * nb,
                         q.xc + m0 * nb, K, nb, ym, N, pf, 0, 1);
          kTileT1[R - 1](wt, st, 16, q.xq + (size_t)m0 * K, q.xs + m0 * nb,
                         q.xc + m0 * nb, K, nb, ym, N, pf, 0, 1);
        }
        continue;
      }
      // Default: row groups of <= 4 over the whole tile (T=2); the tile is
      // re-read from L1/L2 by later groups; prefetching is spread over groups.
      const int G = (q.M + 3) / 4;
      for (int g = 0; g < G; ++g) {
        const int m0 = 4 * g, R = std::min(4, q.M - m0);
        kTileT2[R - 1](wt, st, 0, q.xq + (size_t)m0 * K, q.xs + m0 * nb,
                       q.xc + m0 * nb, K, nb, yt + (size_t)m0 * N, N, g_pf, g,
                       G);
      }
    } else {
      for (int m = 0; m < q.M; ++m) {
        const int8_t* xq = q.xq + (size_t)m * K;
        const float* xs = q.xs + m * nb;
        const int32_t* xc = q.xc + m * nb;
        float* ym = yt + (size_t)m * N;
        if (g_isa == kAvx2)
          tile_avx2_row(wt, st, xq, xs, xc, nb, ym, m == 0 ? g_pf : 0);
        else
          tile_scalar_row(wt, st, xq, xs, xc, nb, ym);
      }
    }
  }
}

struct Shapes {
  int M, K, N;
};

static ffi::Error check(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& wp,
                        ffi::Buffer<ffi::F32>& sp,
                        ffi::ResultBuffer<ffi::F32>& y, Shapes* s) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || yd.size() != xd.size())
    return ffi::Error::InvalidArgument("q8matmul: rank mismatch");
  int64_t K = xd.back(), N = yd.back();
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) {
    if (xd[i] != yd[i]) return ffi::Error::InvalidArgument("q8matmul: batch dims");
    M *= xd[i];
  }
  if (K % kBlock || N % kTile)
    return ffi::Error::InvalidArgument("q8matmul: K and N must be multiples of 32");
  if ((int64_t)wp.element_count() != K * N ||
      (int64_t)sp.element_count() != K * N / kBlock)
    return ffi::Error::InvalidArgument("q8matmul: packed weight/scale size");
  *s = Shapes{(int)M, (int)K, (int)N};
  return ffi::Error::Success();
}

thread_local QAct tl_qact;

ffi::Error ImplST(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                  ffi::Buffer<ffi::F32> sp, ffi::ResultBuffer<ffi::F32> y) {
  Shapes s;
  if (auto e = check(x, wp, sp, y, &s); e.failure()) return e;
  if (s.M == 0) return ffi::Error::Success();
  QAct& q = tl_qact;
  q.resize(s.M, s.K);
  quantize(x.typed_data(), q);
  compute_tiles(q, wp.typed_data(), sp.typed_data(), s.N, 0, s.N / kTile,
                y->typed_data());
  return ffi::Error::Success();
}

// Shared state of one parallel call. Helpers that start late only touch
// `next` (heap state kept alive by shared_ptr) and never the buffers.
static std::atomic<long> g_helper_chunks{0}, g_total_chunks{0}, g_par_calls{0};
struct ParState {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int nchunks = 0, chunk = 0, ntiles = 0, N = 0;
  const QAct* q = nullptr;
  const uint8_t* wp = nullptr;
  const float* sp = nullptr;
  float* y = nullptr;
  void work(bool helper = false) {
    for (;;) {
      int c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= nchunks) return;
      int t0 = c * chunk, t1 = std::min(ntiles, t0 + chunk);
      compute_tiles(*q, wp, sp, N, t0, t1, y);
      if (helper) g_helper_chunks.fetch_add(1, std::memory_order_relaxed);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static const int g_min_par_bytes = env_int("Q8_MIN_PAR_BYTES", 1 << 17);
static const int g_max_threads = env_int("Q8_MAX_THREADS", 64);

ffi::Error ImplMT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::Buffer<ffi::U8> wp, ffi::Buffer<ffi::F32> sp,
                  ffi::ResultBuffer<ffi::F32> y) {
  Shapes s;
  if (auto e = check(x, wp, sp, y, &s); e.failure()) return e;
  if (s.M == 0) return ffi::Error::Success();
  QAct& q = tl_qact;
  q.resize(s.M, s.K);
  quantize(x.typed_data(), q);
  const int ntiles = s.N / kTile;
  int nthr = (int)std::min<int64_t>(pool.num_threads(), g_max_threads);
  static bool once = [&] {
    if (std::getenv("Q8_DEBUG"))
      std::fprintf(stderr, "q8: XLA pool num_threads=%d\n", (int)pool.num_threads());
    return true;
  }();
  (void)once;
  if (nthr <= 1 || (int64_t)s.K * s.N < g_min_par_bytes || ntiles < 2) {
    compute_tiles(q, wp.typed_data(), sp.typed_data(), s.N, 0, ntiles,
                  y->typed_data());
    return ffi::Error::Success();
  }
  auto st = std::make_shared<ParState>();
  // ~4 chunks per thread for dynamic balance (result does not depend on it).
  st->chunk = std::max(1, ntiles / (4 * nthr));
  st->nchunks = (ntiles + st->chunk - 1) / st->chunk;
  st->ntiles = ntiles;
  st->N = s.N;
  st->q = &q;
  st->wp = wp.typed_data();
  st->sp = sp.typed_data();
  st->y = y->typed_data();
  int helpers = std::min(nthr - 1, st->nchunks - 1);
  for (int i = 0; i < helpers; ++i) pool.Schedule([st] { st->work(true); });
  st->work();
  g_total_chunks += st->nchunks;
  g_par_calls += 1;
  int spins = 0;
  while (st->done.load(std::memory_order_acquire) < st->nchunks) {
    if (++spins < 4096)
      _mm_pause();
    else
      std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8MatmulST, ImplST,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8MatmulMT, ImplMT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int q8_isa() { return (int)g_isa; }

// Standalone timing helper (no JAX): median ns of `reps` single-thread calls
// over `nmat` distinct weight copies (to defeat caching when nmat is large).
#include <chrono>
extern "C" double q8_bench_st(int M, int K, int N, int nmat, int reps) {
  std::vector<std::vector<uint8_t>> w(nmat, std::vector<uint8_t>((size_t)K * N));
  std::vector<std::vector<float>> s(nmat, std::vector<float>((size_t)K * N / 32));
  uint32_t r = 12345;
  for (auto& v : w) for (auto& e : v) { r = r * 1664525u + 1013904223u; e = (uint8_t)(1 + (r >> 24) % 255); }
  for (auto& v : s) for (auto& e : v) e = 0.01f;
  std::vector<float> x((size_t)M * K), y((size_t)M * N);
  for (auto& e : x) { r = r * 1664525u + 1013904223u; e = (float)((int)(r >> 16) % 1000) * 0.001f; }
  QAct q;
  q.resize(M, K);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < nmat; ++j) {
      quantize(x.data(), q);
      compute_tiles(q, w[j].data(), s[j].data(), N, 0, N / kTile, y.data());
    }
    auto t1 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / nmat);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

extern "C" void q8_par_stats(long* out) {
  out[0] = g_par_calls; out[1] = g_total_chunks; out[2] = g_helper_chunks;
}
