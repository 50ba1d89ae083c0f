// Float32 products of a decode step or a prefill chunk as an MLX primitive:
// y [M, N] = x [M, K] @ w [N, K].T, as dot products for a few rows of x and as outer products
// for more (simd_gemm below).
//
// A batched decode step multiplies a few rows by every weight matrix. OpenBLAS's sgemm with so
// few rows reads the weights at about a quarter of sgemv's speed (packing panels made for big
// M), so a batch of 4 costs about 4 single rows. This kernel streams w once at memory speed:
// a tile of R weight rows meets MB rows of x with R * MB accumulators in registers, so each
// weight vector loaded feeds MB fused multiply-adds and each activation vector R. With more
// than MB rows of x, the next MB rows reuse the same panel of weight rows from L1/L2, not
// from memory; x is walked in column blocks that stay in L1 across the panel. Output rows
// split over the thread pool that the quantized GEMV uses. kernels/native.py sends it up to
// 256 rows, a short prefill's (DENSE_ROWS: where it beats sgemm, BENCHMARKS.md).
//
// Every output is one float32 dot product: per SIMD lane a running sum over K / width terms,
// then the lanes added (dot products), or one running sum over K (outer products); the order
// differs from BLAS's, the precision does not.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "buffers.h"
#include "pool.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace chatml {
namespace {

#if defined(__AVX512F__)
// 32 vector registers: R * MB accumulators + R weight vectors + 1 activation vector.
struct Vec {
  using T = __m512;
  using Mask = __mmask16;
  static constexpr int kWidth = 16;
  static constexpr int kMaxRows = 8;  // rows of x per tile (MB)
  static T zero() {
    return _mm512_setzero_ps();
  }
  static T load(const float* p) {
    return _mm512_loadu_ps(p);
  }
  static Mask lanes(int lo, int hi) {  // lanes [lo, hi)
    return static_cast<Mask>(((1u << hi) - 1) & ~((1u << lo) - 1));
  }
  static bool all(Mask m) {
    return m == 0xFFFF;
  }
  static T load(const float* p, Mask m) {  // masked-off lanes read as 0 and never fault
    return _mm512_maskz_loadu_ps(m, p);
  }
  static T fma(T a, T b, T c) {
    return _mm512_fmadd_ps(a, b, c);
  }
  static T broadcast(const float* p) {
    return _mm512_set1_ps(*p);
  }
  static void store(float* p, T v) {
    _mm512_store_ps(p, v);
  }
  static float sum(T v) {
    return _mm512_reduce_add_ps(v);
  }
};
constexpr int weight_rows(int mb) {
  return mb <= 2 ? 6 : mb <= 4 ? 4 : mb <= 6 ? 3 : 2;
}
// The outer-product kernel (many rows): kGemmRows weight rows x up to kGemmVecs vectors of x
// columns: 8 x 3 = 24 accumulators + 3 activation vectors + 1 broadcast weight.
constexpr int kGemmRows = 8;
constexpr int kGemmVecs = 3;
#define CHATML_DENSE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
// 16 vector registers: R * MB accumulators + R weight vectors + 1 activation vector.
struct Vec {
  using T = __m256;
  struct Mask {
    __m256i bits;
    bool full;
  };
  static constexpr int kWidth = 8;
  static constexpr int kMaxRows = 4;
  static T zero() {
    return _mm256_setzero_ps();
  }
  static T load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  static Mask lanes(int lo, int hi) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1)),
                                  _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
    return {in, lo == 0 && hi == kWidth};
  }
  static bool all(Mask m) {
    return m.full;
  }
  static T load(const float* p, Mask m) {
    return _mm256_maskload_ps(p, m.bits);
  }
  static T fma(T a, T b, T c) {
    return _mm256_fmadd_ps(a, b, c);
  }
  static T broadcast(const float* p) {
    return _mm256_broadcast_ss(p);
  }
  static void store(float* p, T v) {
    _mm256_store_ps(p, v);
  }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
constexpr int weight_rows(int mb) {
  // At three or four rows of x, three weight rows fit the 16 registers (12 + 3 + 1); at four
  // rows they measured 3-13% faster than two on the 0.8B's shapes, and never slower.
  return mb <= 1 ? 6 : mb <= 2 ? 4 : 3;
}
// The outer-product kernel: 6 x 2 = 12 accumulators + 2 activation vectors + 1 broadcast.
constexpr int kGemmRows = 6;
constexpr int kGemmVecs = 2;
#define CHATML_DENSE_SIMD 1
#endif

// The portable kernel (NEON and unknown CPUs; CHATML_GEMV_ISA=generic on any): 8 running
// sums per dot product, which compilers vectorize.
void generic_gemv(const float* x, const float* w, float* y, int M, int N, int K, int n0,
                  int n1) {
  for (int n = n0; n < n1; ++n) {
    const float* wn = w + static_cast<size_t>(n) * K;
    for (int m = 0; m < M; ++m) {
      const float* xm = x + static_cast<size_t>(m) * K;
      float acc[8] = {0};
      int k = 0;
      for (; k + 8 <= K; k += 8) {
        for (int j = 0; j < 8; ++j) {
          acc[j] += wn[k + j] * xm[k + j];
        }
      }
      for (int j = 0; k < K; ++k, ++j) {
        acc[j] += wn[k] * xm[k];
      }
      float dot = 0.0f;
      for (int j = 0; j < 8; ++j) {
        dot += acc[j];
      }
      y[static_cast<size_t>(m) * N + n] = dot;
    }
  }
}

#if defined(CHATML_DENSE_SIMD)
constexpr int W = Vec::kWidth;
constexpr int kPanel = 24;  // weight rows per panel: a multiple of every weight_rows(mb)
constexpr int kBlockBytes = 24 << 10;  // a column block of the MB rows of x: stays in L1
constexpr int kPrefetchTiles = 2;      // tiles of weight rows ahead to prefetch (see step)

// The layout both operands are walked in. Weight rows start `phase` floats past a 64-byte
// boundary (MLX's allocator hands out buffers 24 bytes past one), so each row is read from
// its aligned start `w_row - phase` over `vecs` whole vectors, the first and last masked:
// no load then splits a cache line. The activations are copied once per call into the same
// phase, zero-padded, so vector v of a weight row meets vector v of each x row.
struct Layout {
  int phase;      // floats between the 64-byte boundary and each weight row's start
  int vecs;       // vectors per (padded) row
  size_t ldw;     // floats between weight rows (K)
  size_t ldx;     // floats between rows of the prepared activations
  Vec::Mask head;  // lanes of vector 0 inside the row
  Vec::Mask tail;  // lanes of vector vecs - 1 inside the row
};

Layout layout_for(const float* w, int K) {
  Layout l;
  // With K a multiple of the width every row shares the first row's phase; otherwise rows
  // differ, and unaligned loads of each row are the price.
  l.phase = K % W == 0 ? static_cast<int>((reinterpret_cast<uintptr_t>(w) % 64) / 4) % W : 0;
  l.vecs = (l.phase + K + W - 1) / W;
  l.ldw = K;
  l.ldx = static_cast<size_t>(l.vecs) * W;
  if (l.ldx % 1024 == 0) {
    l.ldx += W;  // rows exactly 4 KiB apart would share L1 sets
  }
  const int end = (l.phase + K) - (l.vecs - 1) * W;  // lanes used in the last vector
  l.head = Vec::lanes(l.phase, l.vecs == 1 ? end : W);
  l.tail = l.vecs == 1 ? l.head : Vec::lanes(0, end);
  return l;
}

template <int R, int MB, bool MASKED>
inline void step(typename Vec::T (&acc)[R][MB], const float* w, const float* x,
                 const Layout& l, int v, typename Vec::Mask mask) {
  typename Vec::T wv[R];
  for (int r = 0; r < R; ++r) {
    const float* p = w + r * l.ldw + static_cast<size_t>(v) * W;
    wv[r] = MASKED ? Vec::load(p, mask) : Vec::load(p);
    // The hardware prefetcher loses track of rows read a tile at a time (R rows of 4 KiB
    // interleaved, for K = 1024): fetch the same bytes of the rows two tiles ahead into L2.
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchTiles * R * l.ldw), _MM_HINT_T1);
  }
  for (int m = 0; m < MB; ++m) {
    typename Vec::T xv = Vec::load(x + m * l.ldx + static_cast<size_t>(v) * W);
    asm("" : "+v"(xv));  // keep it in a register: folded into each FMA it is reloaded R times
    for (int r = 0; r < R; ++r) {
      acc[r][m] = Vec::fma(wv[r], xv, acc[r][m]);
    }
  }
}

// R weight rows (from their aligned starts w) times MB prepared x rows over vectors [v0, v1):
// accumulators start from `part` (or 0 when v0 == 0) and end in `part`, or, when v1 is the
// row's end, summed into y[m * ldy + r].
template <int R, int MB>
inline void tile(const float* w, const float* x, const Layout& l, int v0, int v1,
                 typename Vec::T* part, float* y, size_t ldy) {
  typename Vec::T acc[R][MB];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      acc[r][m] = v0 == 0 ? Vec::zero() : part[r * MB + m];
    }
  }
  int v = v0, end = v1;
  if (v == 0 && !Vec::all(l.head)) {
    step<R, MB, true>(acc, w, x, l, v++, l.head);
  }
  const bool last = v1 == l.vecs;
  if (last && v < v1 && !Vec::all(l.tail)) {
    --end;
  }
  for (; v < end; ++v) {
    step<R, MB, false>(acc, w, x, l, v, l.head);
  }
  if (v < v1) {
    step<R, MB, true>(acc, w, x, l, v, l.tail);
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      if (last) {
        y[m * ldy + r] = Vec::sum(acc[r][m]);
      } else {
        part[r * MB + m] = acc[r][m];
      }
    }
  }
}

// Weight rows [n0, n1) (a panel) times MB prepared x rows, into y (row stride ldy), column
// block by column block: each block of x is read from L1 by every tile of the panel.
template <int MB>
void panel(const float* w, const float* x, const Layout& l, int n0, int n1, float* y,
           size_t ldy) {
  constexpr int R = weight_rows(MB);
  alignas(64) typename Vec::T part[kPanel * MB];
  // Column blocks of equal size, each at most kBlockBytes of x.
  const int most = std::max(1, kBlockBytes / (MB * W * static_cast<int>(sizeof(float))));
  const int blocks = (l.vecs + most - 1) / most, size = (l.vecs + blocks - 1) / blocks;
  for (int v0 = 0; v0 < l.vecs; v0 += size) {
    const int v1 = std::min(l.vecs, v0 + size);
    int n = n0;
    for (; n + R <= n1; n += R) {
      tile<R, MB>(w + n * l.ldw - l.phase, x, l, v0, v1, part + (n - n0) * MB, y + n, ldy);
    }
    for (; n < n1; ++n) {
      tile<1, MB>(w + n * l.ldw - l.phase, x, l, v0, v1, part + (n - n0) * MB, y + n, ldy);
    }
  }
}

using PanelFn = void (*)(const float*, const float*, const Layout&, int, int, float*, size_t);

PanelFn panel_for(int mb) {
  static const PanelFn table[] = {
      nullptr,  panel<1>, panel<2>, panel<3>, panel<4>,
#if defined(__AVX512F__)
      panel<5>, panel<6>, panel<7>, panel<8>,
#endif
  };
  return table[mb];
}

struct AlignedFree {
  void operator()(float* p) const {
    std::free(p);
  }
};

void simd_gemv(const float* x, const float* w, float* y, int M, int N, int K) {
  const Layout l = layout_for(w, K);
  // x in the weights' phase, zero-padded, 64-byte aligned rows.
  const size_t floats = l.ldx * M;
  std::unique_ptr<float, AlignedFree> xs(
      static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64)));
  std::fill(xs.get(), xs.get() + floats, 0.0f);
  for (int m = 0; m < M; ++m) {
    std::copy(x + static_cast<size_t>(m) * K, x + static_cast<size_t>(m + 1) * K,
              xs.get() + m * l.ldx + l.phase);
  }
  // Rows of x in equal blocks of at most kMaxRows (16 rows: 8 + 8; 12 rows: 6 + 6).
  const int blocks = (M + Vec::kMaxRows - 1) / Vec::kMaxRows;
  auto job = [&](int part, int parts) {
    // Contiguous ranges of weight rows, multiples of 48 (whole panels, whole cache lines of y).
    int chunk = ((N + parts - 1) / parts + 47) / 48 * 48;
    int n0 = std::min(N, part * chunk), n1 = std::min(N, n0 + chunk);
    for (int p0 = n0; p0 < n1; p0 += kPanel) {  // the panel stays in cache across the blocks
      const int p1 = std::min(n1, p0 + kPanel);
      for (int b = 0; b < blocks; ++b) {
        const int m0 = M * b / blocks, m1 = M * (b + 1) / blocks;
        panel_for(m1 - m0)(w, xs.get() + m0 * l.ldx, l, p0, p1, y + static_cast<size_t>(m0) * N,
                           N);
      }
    }
  };
  pool().run(job, parts_for(static_cast<size_t>(N) * K * sizeof(float)));
}

// Many rows of x: outer products. With more rows than a dot-product tile holds, every weight
// vector loaded above meets only MB rows, and each output ends in a horizontal sum. Here the
// product is computed as y.T = w @ x.T: x is packed once per call, transposed, in blocks of
// up to kGemmVecs vectors of its rows ([block][K][block width], zero-padded), and each step
// broadcasts one weight from each of kGemmRows weight rows and multiplies it by a block's
// activations: kGemmRows * NV fused multiply-adds for NV loads and kGemmRows broadcasts, no
// horizontal sums, the weights read in place (the big operand is never packed).
//
// The loops keep both operands in cache. K is cut into slabs (`slab_columns`): one slab of the
// packed x, every block, stays in L2 while the tiles of weight rows pass over it, and a tile's
// slab of weights (kGemmRows rows x the slab's columns) stays in L1 while it meets every
// block. Without slabs the whole packed x had to stay in L2: at 256 rows and K = 3584 (3.5
// MiB) it came from L3 for every tile, and sgemm was 1.4x faster. Between slabs each tile
// keeps its running sums in `partial`, for kChunkRows weight rows at a time, so w is still
// streamed from memory once. Each output is still one float32 dot product, its terms added in
// k order: the running sum goes on from where the last slab left it, so slabs change no bit.

// Bytes of packed x in one slab: within L2 on every x86-64 core this kernel runs on (1 MiB
// on Zen 4, 2 MiB on recent Xeons), with room for the weights and partial sums streaming by.
constexpr size_t kSlabBytes = 256 << 10;
constexpr int kChunkRows = 96;  // weight rows whose partial sums are kept between slabs

struct Blocks {
  std::vector<int> m0;    // first row of x in each block
  std::vector<int> vecs;  // vectors per block (block width = vecs * W)
  std::vector<size_t> at;  // floats from the packed buffer's start to the block
  size_t floats = 0;       // the packed buffer's size
  int width = 0;           // rows of x, padded: the blocks' widths added
};

// Rows of x in blocks as even as possible of at most kGemmVecs vectors: 4 vectors as 2 + 2,
// not 3 + 1 (a one-vector block does a broadcast per multiply-add).
Blocks blocks_for(int M, int K) {
  Blocks b;
  const int vecs = (M + W - 1) / W;
  const int count = (vecs + kGemmVecs - 1) / kGemmVecs;
  for (int i = 0, v = 0; i < count; ++i) {
    const int v1 = static_cast<int>(static_cast<int64_t>(vecs) * (i + 1) / count);
    b.m0.push_back(v * W);
    b.vecs.push_back(v1 - v);
    b.at.push_back(b.floats);
    b.floats += static_cast<size_t>(K) * (v1 - v) * W;
    v = v1;
  }
  b.width = vecs * W;
  return b;
}

// Columns of K per slab: as many as keep a slab of `width` packed rows within kSlabBytes, in
// whole cache lines of a weight row, and all of K when it fits.
int slab_columns(int K, int width) {
  const size_t fit = kSlabBytes / (static_cast<size_t>(width) * sizeof(float)) / 16 * 16;
  return static_cast<int>(std::min<size_t>(K, std::max<size_t>(64, fit)));
}

// Packs rows [m0, m0 + vecs * W) of x (M rows of K) as [K][vecs * W], rows past M as zeros.
void pack(const float* x, int M, int K, int m0, int vecs, float* out) {
  const int width = vecs * W;
  for (int m = 0; m < width; ++m) {
    float* col = out + m;
    if (m0 + m < M) {
      const float* row = x + static_cast<size_t>(m0 + m) * K;
      for (int k = 0; k < K; ++k) {
        col[static_cast<size_t>(k) * width] = row[k];
      }
    } else {
      for (int k = 0; k < K; ++k) {
        col[static_cast<size_t>(k) * width] = 0.0f;
      }
    }
  }
}

// Where one tile's pass over one block of one slab starts and ends.
struct Pass {
  int count;    // columns of K in the slab
  float* part;  // the tile's running sums for the block (kGemmRows x NV vectors), or null
  bool first;   // the slab starts at column 0: the sums start at 0, not from `part`
  bool last;    // the slab ends at column K: the sums go to y, not to `part`
};

// kGemmRows weight rows (row r at w + off[r], w at the slab's first column) times a packed
// block of NV vectors of x (xt at the slab's first column) over the slab's columns:
// y[m][n + r] for the block's `rows` rows of x and the tile's first `live` weight rows.
// `ahead` (or null) is the next tile's first row: its bytes are prefetched into L2 as this
// tile's are used, for the tiles after the first.
// The accumulators must live in registers. GCC (12) keeps an array of vectors that any loop
// indexes in memory, storing each one back in every step of k, unless every loop over it is
// unrolled early: hence the pragmas, and the copy to `out` before the rows that are live.
template <int NV>
void gemm_tile(const float* w, const size_t (&off)[kGemmRows], int live, const float* xt,
               const Pass& pass, int rows, float* y, size_t ldy, const float* ahead) {
  using T = typename Vec::T;
  T acc[kGemmRows][NV];
#pragma GCC unroll 16
  for (int r = 0; r < kGemmRows; ++r) {
  #pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      acc[r][j] = pass.first ? Vec::zero() : Vec::load(pass.part + (r * NV + j) * W);
    }
  }
  constexpr int kWidth = NV * W;
  const int K = pass.count;
  for (int k0 = 0; k0 < K; k0 += 16) {  // 16 columns: one cache line of each weight row
    if (ahead != nullptr) {
#pragma GCC unroll 16
      for (int r = 0; r < kGemmRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + off[r] + k0), _MM_HINT_T1);
      }
    }
    const int k1 = std::min(K, k0 + 16);
    for (int k = k0; k < k1; ++k) {
      T xv[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        xv[j] = Vec::load(xt + static_cast<size_t>(k) * kWidth + j * W);
      }
#pragma GCC unroll 16
      for (int r = 0; r < kGemmRows; ++r) {
        const T b = Vec::broadcast(w + off[r] + k);
  #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) {
          acc[r][j] = Vec::fma(b, xv[j], acc[r][j]);
        }
      }
    }
  }
  if (!pass.last) {
#pragma GCC unroll 16
    for (int r = 0; r < kGemmRows; ++r) {
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        Vec::store(pass.part + (r * NV + j) * W, acc[r][j]);
      }
    }
    return;
  }
  alignas(64) float out[kGemmRows][kWidth];
#pragma GCC unroll 16
  for (int r = 0; r < kGemmRows; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      Vec::store(out[r] + j * W, acc[r][j]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    for (int r = 0; r < live; ++r) {
      y[m * ldy + r] = out[r][m];
    }
  }
}

using GemmTileFn = void (*)(const float*, const size_t (&)[kGemmRows], int, const float*,
                            const Pass&, int, float*, size_t, const float*);

GemmTileFn gemm_tile_for(int vecs) {
  static const GemmTileFn table[] = {nullptr, gemm_tile<1>, gemm_tile<2>,
#if defined(__AVX512F__)
                                     gemm_tile<3>,
#endif
  };
  return table[vecs];
}

void simd_gemm(const float* x, const float* w, float* y, int M, int N, int K) {
  const Blocks b = blocks_for(M, K);
  const int count = static_cast<int>(b.m0.size());
  std::unique_ptr<float, AlignedFree> xt(
      static_cast<float*>(std::aligned_alloc(64, (b.floats * sizeof(float) + 63) / 64 * 64)));
  auto pack_blocks = [&](int part, int parts) {
    for (int i = part; i < count; i += parts) {
      pack(x, M, K, b.m0[i], b.vecs[i], xt.get() + b.at[i]);
    }
  };
  pool().run(pack_blocks, static_cast<size_t>(M) * K >= (64u << 10) ? count : 1);
  const int kc = slab_columns(K, b.width);
  auto job = [&](int part, int parts) {
    int chunk = ((N + parts - 1) / parts + 47) / 48 * 48;
    int n0 = std::min(N, part * chunk), n1 = std::min(N, n0 + chunk);
    std::unique_ptr<float, AlignedFree> partial;  // kChunkRows x width running sums
    if (kc < K) {
      partial.reset(static_cast<float*>(
          std::aligned_alloc(64, static_cast<size_t>(kChunkRows) * b.width * sizeof(float))));
    }
    for (int c0 = n0; c0 < n1; c0 += kChunkRows) {
      const int c1 = std::min(n1, c0 + kChunkRows);
      for (int k0 = 0; k0 < K; k0 += kc) {
        const int k1 = std::min(K, k0 + kc);
        for (int n = c0; n < c1; n += kGemmRows) {
          const int live = std::min(kGemmRows, c1 - n);
          size_t off[kGemmRows];  // rows past the range repeat its last row; sums dropped
          for (int r = 0; r < kGemmRows; ++r) {
            off[r] = static_cast<size_t>(std::min(r, live - 1)) * K;
          }
          const float* tile = w + static_cast<size_t>(n) * K + k0;
          // the next tile, when it is a whole one (prefetches stay inside w)
          const float* ahead =
              n + 2 * kGemmRows <= c1 ? tile + static_cast<size_t>(kGemmRows) * K : nullptr;
          for (int i = 0; i < count; ++i) {
            const int rows = std::min(M - b.m0[i], b.vecs[i] * W);
            float* part_sums = partial ? partial.get() + static_cast<size_t>(n - c0) * b.width +
                                             static_cast<size_t>(kGemmRows) * b.m0[i]
                                       : nullptr;
            const Pass pass{k1 - k0, part_sums, k0 == 0, k1 == K};
            gemm_tile_for(b.vecs[i])(tile, off, live,
                                     xt.get() + b.at[i] + static_cast<size_t>(k0) * b.vecs[i] * W,
                                     pass, rows, y + static_cast<size_t>(b.m0[i]) * N + n, N,
                                     i == 0 ? ahead : nullptr);
          }
        }
      }
    }
  };
  pool().run(job, parts_for(static_cast<size_t>(N) * K * sizeof(float)));
}
// Outer products from 3 dot-product tiles of rows on (25 with AVX-512, 13 with AVX2): measured
// with `bench.qgemv --batch ... --forms`, where they overtake the dot products.
constexpr int kGemmFrom = 3 * Vec::kMaxRows + 1;
constexpr bool kSimd = true;
#else
void simd_gemv(const float*, const float*, float*, int, int, int) {}
void simd_gemm(const float*, const float*, float*, int, int, int) {}
constexpr int kGemmFrom = 0;
constexpr bool kSimd = false;
#endif

bool use_generic() {
  const char* env = std::getenv("CHATML_GEMV_ISA");
  return !kSimd || (env != nullptr && std::string(env) == "generic");
}

// Which kernel multiplies: the dot products (kDot), the outer products (kOuter), or by the
// number of rows (kAuto: outer products from kGemmFrom rows on).
enum Form { kAuto = 0, kDot = 1, kOuter = 2 };

void dense_gemv_impl(const float* x, const float* w, float* y, int M, int N, int K, int form) {
  if (M == 0 || N == 0) {
    return;
  }
  if (!use_generic()) {
    if (form == kOuter || (form == kAuto && M >= kGemmFrom)) {
      simd_gemm(x, w, y, M, N, K);
    } else {
      simd_gemv(x, w, y, M, N, K);
    }
    return;
  }
  auto job = [&](int part, int parts) {
    int chunk = ((N + parts - 1) / parts + 15) / 16 * 16;
    int n0 = std::min(N, part * chunk), n1 = std::min(N, n0 + chunk);
    generic_gemv(x, w, y, M, N, K, n0, n1);
  };
  pool().run(job, parts_for(static_cast<size_t>(N) * K * sizeof(float)));
}

class DenseGemv : public UnaryPrimitive {
 public:
  DenseGemv(Stream stream, int form) : UnaryPrimitive(stream), form_(form) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(inputs[1]);
    encoder.set_output_array(out);
    const array x = row_major(inputs[0], encoder);
    const array w = row_major(inputs[1], encoder);
    const int M = x.shape(0), K = x.shape(1), N = out.shape(1);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), yp = out.data<float>(), M, N,
                      K, form = form_]() { dense_gemv_impl(xp, wp, yp, M, N, K, form); });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[chatml.dense_gemv] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlDenseGemv";
  }

  bool is_equivalent(const Primitive& other) const override {
    return form_ == static_cast<const DenseGemv&>(other).form_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0)}};
  }

 private:
  int form_;
};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.dense_gemv] " + what);
  }
}

// x [..., K] @ w [N, K].T -> [..., N], float32. Inputs that are not row-major (a transposed
// view) are copied to row-major while it runs; others are read in place.
array dense_gemv(const array& x, const array& w, const std::string& form) {
  check(w.dtype() == float32 && w.ndim() == 2, "w must be a 2-D float32 array [N, K]");
  check(x.dtype() == float32 && x.ndim() >= 1, "x must be a float32 array [..., K]");
  const int N = w.shape(0), K = w.shape(1);
  std::ostringstream shapes;
  shapes << "x has " << x.shape(-1) << " columns, w has " << K << " per row";
  check(x.shape(-1) == K, shapes.str());
  check(K > 0 && N > 0, "w must not be empty");
  check(form == "auto" || form == "dot" || form == "outer",
        "form must be \"auto\", \"dot\" or \"outer\", not \"" + form + "\"");
  const int f = form == "dot" ? kDot : form == "outer" ? kOuter : kAuto;
  Stream s = default_stream(Device::cpu);
  const int M = static_cast<int>(x.size() / K);
  array y(Shape{M, N}, float32, std::make_shared<DenseGemv>(s, f), {reshape(x, {M, K}, s), w});
  Shape out_shape = x.shape();
  out_shape.back() = N;
  return reshape(y, out_shape, s);
}

}  // namespace

void bind_dense(nb::module_& m) {
  m.def("dense_gemv", &dense_gemv, nb::arg("x"), nb::arg("w"), nb::arg("form") = "auto",
        "x @ w.T for float32 x [..., K] and w [N, K] on the CPU, reading w once: dot products "
        "for a few rows of x, outer products for more (form: auto, dot or outer).");
  m.def("dense_outer_from", [] { return use_generic() ? 0 : kGemmFrom; },
        "Rows of x from which dense_gemv's auto form runs outer products (0: never).");
}

}  // namespace chatml
