// Float32 GEMV over a few rows as an MLX primitive: y [M, N] = x [M, K] @ w [N, K].T.
//
// A batched decode step multiplies a few rows by every weight matrix. OpenBLAS's sgemm with so
// few rows reads the weights at about a quarter of sgemv's speed (packing panels made for big
// M), so a batch of 4 costs about 4 single rows. This kernel streams w once at memory speed:
// a tile of R weight rows meets MB rows of x with R * MB accumulators in registers, so each
// weight vector loaded feeds MB fused multiply-adds and each activation vector R. With more
// than MB rows of x, the next MB rows reuse the same panel of weight rows from L1/L2, not
// from memory; x is walked in column blocks that stay in L1 across the panel. Output rows
// split over the thread pool that the quantized GEMV uses. kernels/native.py sends it 2-32
// rows (DENSE_ROWS: where it beats sgemm, BENCHMARKS.md).
//
// Every output is one float32 dot product: per SIMD lane a running sum over K / width terms,
// then the lanes added; the order differs from BLAS's, the precision does not.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

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
  static float sum(T v) {
    return _mm512_reduce_add_ps(v);
  }
};
constexpr int weight_rows(int mb) {
  return mb <= 2 ? 6 : mb <= 4 ? 4 : mb <= 6 ? 3 : 2;
}
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
constexpr bool kSimd = true;
#else
void simd_gemv(const float*, const float*, float*, int, int, int) {}
constexpr bool kSimd = false;
#endif

bool use_generic() {
  const char* env = std::getenv("CHATML_GEMV_ISA");
  return !kSimd || (env != nullptr && std::string(env) == "generic");
}

void dense_gemv_impl(const float* x, const float* w, float* y, int M, int N, int K) {
  if (M == 0 || N == 0) {
    return;
  }
  if (!use_generic()) {
    simd_gemv(x, w, y, M, N, K);
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
  explicit DenseGemv(Stream stream) : UnaryPrimitive(stream) {}

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
                      K]() { dense_gemv_impl(xp, wp, yp, M, N, K); });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[chatml.dense_gemv] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlDenseGemv";
  }

  bool is_equivalent(const Primitive&) const override {
    return true;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0)}};
  }
};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.dense_gemv] " + what);
  }
}

// x [..., K] @ w [N, K].T -> [..., N], float32. Inputs that are not row-major (a transposed
// view) are copied to row-major while it runs; others are read in place.
array dense_gemv(const array& x, const array& w) {
  check(w.dtype() == float32 && w.ndim() == 2, "w must be a 2-D float32 array [N, K]");
  check(x.dtype() == float32 && x.ndim() >= 1, "x must be a float32 array [..., K]");
  const int N = w.shape(0), K = w.shape(1);
  std::ostringstream shapes;
  shapes << "x has " << x.shape(-1) << " columns, w has " << K << " per row";
  check(x.shape(-1) == K, shapes.str());
  check(K > 0 && N > 0, "w must not be empty");
  Stream s = default_stream(Device::cpu);
  const int M = static_cast<int>(x.size() / K);
  array y(Shape{M, N}, float32, std::make_shared<DenseGemv>(s), {reshape(x, {M, K}, s), w});
  Shape out_shape = x.shape();
  out_shape.back() = N;
  return reshape(y, out_shape, s);
}

}  // namespace

void bind_dense(nb::module_& m) {
  m.def("dense_gemv", &dense_gemv, nb::arg("x"), nb::arg("w"),
        "x @ w.T for float32 x [..., K] and w [N, K] on the CPU, reading w once (few rows).");
}

}  // namespace chatml
