// The gated delta rule for a few tokens as one MLX primitive, one pass over each state row.
//
// Per batch row b and value head h (state S [Dv, Dk], key head h / (Hv / Hk)), each token t:
//     S = g_t S;  u = beta_t (v_t - S k_t);  S += u k_t^T;  y_t = S q_t
// Row i of S meets only v_t[i]: row by row, S[i] is read once from memory, and for every
// token dotted with k and q (one loop over the row), then decayed and updated (a second loop,
// in L1) before the next row; y_t[i] = g_t (S[i] q_t) + u[i] (k_t q_t). MLX's ops make several passes over the
// whole [B, Hv, Dv, Dk] state per token (decay, k^T S, the rank-1 update, q S); past the
// caches (a batch of 8 rows of a 0.8B model holds 8 MiB of state per layer) each pass costs a
// trip to memory. Here a step costs one read and one write of each state.
//
// The rows' states come as separate arrays (one per sequence of a batched decode step) and
// leave as separate arrays: nothing is stacked or split around the step. A state that nobody
// else holds is updated in place. Heads split over the thread pool of the GEMV kernels.
//
// float32 throughout; each dot product is summed per SIMD lane, then across lanes.

#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "buffers.h"
#include "pool.h"
#include "vexp.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace chatml {
namespace {

using namespace simd;  // the vector type, load, store, lane sums and dots (vexp.h)

struct Shapes {
  int B, T, Hk, Hv, Dk, Dv;
};

// Every token of one row of one head: `in` (the state row before the step, Dk floats) to
// `out` (after it; may be `in` itself). x_t points at token t's q or k of the row's key head
// (stride: tokens), v_i at v_t[i] (stride: tokens too), y_i at y_t[i]; kq[t] = k_t . q_t.
// A token reads the row once for both of its dots, S k and S q, then writes it decayed and
// updated: y = (g S + u k^T) q = g (S q) + u (k . q), so no sum waits on the written row and
// the rows of a head are independent chains the CPU overlaps (a decode step is one token).
inline void row(const float* in, float* out, const float* q, const float* k, size_t xs,
                const float* v, const float* g, const float* beta, size_t hs, const float* kq,
                float* y, const Shapes& s) {
  const int Dk = s.Dk;
  const float* src = in;
  for (int t = 0; t < s.T; ++t, src = out) {
    const float* qt = q + t * xs;
    const float* kt = k + t * xs;
    const float gt = g[t * hs], bt = beta[t * hs];
    vf ak = {}, aq = {};
    int j = 0;
    for (; j + L <= Dk; j += L) {
      const vf x = load(src + j);
      ak += x * load(kt + j);
      aq += x * load(qt + j);
    }
    float sk = hsum(ak), sq = hsum(aq);
    for (; j < Dk; ++j) {
      sk += src[j] * kt[j];
      sq += src[j] * qt[j];
    }
    const float u = bt * (v[t * hs * s.Dv] - gt * sk);  // (g S) k = g (S k)
    y[t * hs * s.Dv] = gt * sq + u * kq[t];
    for (j = 0; j + L <= Dk; j += L) {
      store(out + j, gt * load(src + j) + u * load(kt + j));
    }
    for (; j < Dk; ++j) {
      out[j] = gt * src[j] + u * kt[j];
    }
  }
}

// A prefill segment: a head's rows L or 2L at a time, from T = kBlockFrom tokens on.
// Token by token, one row alone is a chain of dependent steps (its dot with k, summed across
// the lanes; then the update and its dot with q, summed again) that leaves the FMA units
// idle: ~70 us a token for a 0.8B layer's 16 heads on two Xeon cores. Here a block's states
// are held transposed in `st` (column j of L rows in one vector), so each dot is
// Dk multiply-adds by a broadcast k[j] or q[j] into several running vectors, one row a lane: no
// sums across lanes, and L independent rows in every instruction. The block stays in L1 for
// the whole segment; the transposes in and out cost a few tokens' worth, hence kBlockFrom.
// Each row still meets the same terms: only the order of the sums over Dk differs.
constexpr int kBlockFrom = 8;

// NB blocks of L rows at once: `st` holds them as [Dk][NB][L], so each broadcast of k[j] or
// q[j] feeds NB multiply-adds, and the sums run in 4 * NB independent chains.
template <int NB>
void block(const float* in, float* out, const float* q, const float* k, size_t xs,
           const float* v, const float* g, const float* beta, size_t hs, float* y,
           const Shapes& s, float* st) {
  const int Dk = s.Dk;
  constexpr int W = NB * L;  // rows in the block
  for (int r = 0; r < W; ++r) {
    for (int j = 0; j < Dk; ++j) {
      st[j * W + r] = in[r * Dk + j];
    }
  }
  const size_t vs = hs * s.Dv;  // floats between tokens of v or y
  for (int t = 0; t < s.T; ++t) {
    const float* qt = q + t * xs;
    const float* kt = k + t * xs;
    const float gt = g[t * hs], bt = beta[t * hs];
    vf a[4][NB] = {};
    int j = 0;
    for (; j + 4 <= Dk; j += 4) {
      for (int c = 0; c < 4; ++c) {
        for (int b = 0; b < NB; ++b) {
          a[c][b] += load(st + (j + c) * W + b * L) * kt[j + c];
        }
      }
    }
    for (; j < Dk; ++j) {
      for (int b = 0; b < NB; ++b) {
        a[0][b] += load(st + j * W + b * L) * kt[j];
      }
    }
    vf u[NB];
    for (int b = 0; b < NB; ++b) {
      const vf kv = (a[0][b] + a[1][b]) + (a[2][b] + a[3][b]);
      u[b] = bt * (load(v + t * vs + b * L) - gt * kv);  // (g S) k = g (S k)
      a[0][b] = a[1][b] = a[2][b] = a[3][b] = vf{};
    }
    for (j = 0; j + 4 <= Dk; j += 4) {
      for (int c = 0; c < 4; ++c) {
        for (int b = 0; b < NB; ++b) {
          float* p = st + (j + c) * W + b * L;
          const vf next = gt * load(p) + u[b] * kt[j + c];
          store(p, next);
          a[c][b] += next * qt[j + c];
        }
      }
    }
    for (; j < Dk; ++j) {
      for (int b = 0; b < NB; ++b) {
        float* p = st + j * W + b * L;
        const vf next = gt * load(p) + u[b] * kt[j];
        store(p, next);
        a[0][b] += next * qt[j];
      }
    }
    for (int b = 0; b < NB; ++b) {
      store(y + t * vs + b * L, (a[0][b] + a[1][b]) + (a[2][b] + a[3][b]));
    }
  }
  for (int r = 0; r < W; ++r) {
    for (int j = 0; j < Dk; ++j) {
      out[r * Dk + j] = st[j * W + r];
    }
  }
}

// Heads [h0, h1) of the B * Hv (row, value head) pairs. Layouts: q, k [B, T, Hk, Dk];
// v, y [B, T, Hv, Dv]; g, beta [B, T, Hv]; state b at in[b] / out[b], [Hv, Dv, Dk].
void heads(const float* q, const float* k, const float* v, const float* g, const float* beta,
           const std::vector<const float*>& in, const std::vector<float*>& out, float* y,
           const Shapes& s, int h0, int h1) {
  const int r = s.Hv / s.Hk;
  const size_t xs = static_cast<size_t>(s.Hk) * s.Dk;  // floats between tokens of q or k
  const size_t hs = s.Hv;                             // ... of g or beta (v, y: hs * Dv)
  const size_t head = static_cast<size_t>(s.Dv) * s.Dk;
  const int blocked = s.T >= kBlockFrom ? s.Dv / L * L : 0;  // rows taken L at a time
  std::vector<float> st(blocked > 0 ? static_cast<size_t>(s.Dk) * 2 * L : 0);
  std::vector<float> kq(s.T);  // k_t . q_t of the current head, for the rows taken one by one
  for (int bh = h0; bh < h1; ++bh) {
    const int b = bh / s.Hv, h = bh % s.Hv;
    const size_t x0 = static_cast<size_t>(b) * s.T * xs + static_cast<size_t>(h / r) * s.Dk;
    const size_t g0 = static_cast<size_t>(b) * s.T * hs + h;
    const size_t v0 = g0 * s.Dv;
    const float* sin = in[b] + h * head;
    float* sout = out[b] + h * head;
    for (int i = 0; i < blocked; i += 2 * L) {
      const auto f = i + 2 * L <= blocked ? block<2> : block<1>;
      f(sin + i * s.Dk, sout + i * s.Dk, q + x0, k + x0, xs, v + v0 + i, g + g0, beta + g0, hs,
        y + v0 + i, s, st.data());
    }
    if (blocked < s.Dv) {
      for (int t = 0; t < s.T; ++t) {
        kq[t] = dot(k + x0 + t * xs, q + x0 + t * xs, s.Dk);
      }
    }
    for (int i = blocked; i < s.Dv; ++i) {
      row(sin + i * s.Dk, sout + i * s.Dk, q + x0, k + x0, xs, v + v0 + i, g + g0, beta + g0,
          hs, kq.data(), y + v0 + i, s);
    }
  }
}

class GatedDeltaRows : public Primitive {
 public:
  GatedDeltaRows(Stream stream, Shapes shapes, std::vector<int> rows)
      : Primitive(stream), s_(shapes), rows_(std::move(rows)) {}

  // inputs: q, k, v, g, beta, then one state per array of rows; outputs: y, then the states.
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    outputs[0].set_data(allocator::malloc(outputs[0].nbytes()));
    std::vector<const float*> in;
    std::vector<float*> out;
    const size_t per_row = static_cast<size_t>(s_.Hv) * s_.Dv * s_.Dk;
    for (size_t i = 0; i < rows_.size(); ++i) {
      const array& state = inputs[5 + i];
      array& next = outputs[1 + i];
      donate_or_alloc(state, next);  // nobody else holds it: update in place
      for (int b = 0; b < rows_[i]; ++b) {
        in.push_back(state.data<float>() + b * per_row);
        out.push_back(next.data<float>() + b * per_row);
      }
    }
    for (array& a : outputs) {
      encoder.set_output_array(a);
    }
    encoder.dispatch([q = inputs[0].data<float>(), k = inputs[1].data<float>(),
                      v = inputs[2].data<float>(), g = inputs[3].data<float>(),
                      beta = inputs[4].data<float>(), y = outputs[0].data<float>(),
                      in = std::move(in), out = std::move(out), s = s_]() {
      const int n = s.B * s.Hv;
      const size_t bytes = static_cast<size_t>(n) * s.Dv * s.Dk * sizeof(float);
      auto job = [&](int part, int parts) {
        heads(q, k, v, g, beta, in, out, y, s, n * part / parts, n * (part + 1) / parts);
      };
      pool().run(job, bytes < (64u << 10) ? 1 : std::min(n, pool().size()));
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.gated_delta_rows] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlGatedDeltaRows";
  }

  bool is_equivalent(const Primitive& other) const override {
    return rows_ == static_cast<const GatedDeltaRows&>(other).rows_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    std::vector<Shape> shapes{inputs[2].shape()};
    for (size_t i = 5; i < inputs.size(); ++i) {
      shapes.push_back(inputs[i].shape());
    }
    return shapes;
  }

 private:
  Shapes s_;
  std::vector<int> rows_;  // rows (leading size) of each state
};

// The chunked delta rule's (I + A)^-1 for a stack of unit lower-triangular matrices [..., n, n]
// (kernels/triangular.py): forward substitution by rows, X[i] = e_i - sum_{j<i} A[i, j] X[j],
// each row of X a few vectors (only the columns <= j of X[j] are nonzero). Only the strictly
// lower triangle of A is read; X has ones on its diagonal and zeros above it. Matrices split
// over the pool.
//
// LAPACK's strtri (MLX's tri_inv, on the reference BLAS that MLX's wheel ships) makes one
// strmv call per column, scalar: 7x slower on the 0.8B's shapes (BENCHMARKS.md).
void unit_lower_inverse_one(const float* a, float* x, int n, int ldx, float* out) {
  std::fill(x, x + static_cast<size_t>(n) * ldx, 0.0f);
  for (int i = 0; i < n; ++i) {
    float* xi = x + static_cast<size_t>(i) * ldx;
    xi[i] = 1.0f;
    const int used = i / L + 1;  // vectors of row i holding columns <= i
    vf acc[64];  // n <= 64 * L
    for (int v = 0; v < used; ++v) {
      acc[v] = load(xi + v * L);
    }
    const float* ai = a + static_cast<size_t>(i) * n;
    for (int j = 0; j < i; ++j) {
      const float aij = ai[j];
      if (aij == 0.0f) {
        continue;
      }
      const float* xj = x + static_cast<size_t>(j) * ldx;
      const vf s = vf{} + aij;
      for (int v = 0; v <= j / L; ++v) {
        acc[v] -= s * load(xj + v * L);
      }
    }
    for (int v = 0; v < used; ++v) {
      store(xi + v * L, acc[v]);
    }
  }
  for (int i = 0; i < n; ++i) {
    std::memcpy(out + static_cast<size_t>(i) * n, x + static_cast<size_t>(i) * ldx,
                sizeof(float) * n);
  }
}

class UnitLowerInverse : public Primitive {
 public:
  explicit UnitLowerInverse(Stream stream) : Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    const array a = row_major(inputs[0], encoder);
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    const int n = a.shape(-1);
    const size_t count = n ? a.size() / (static_cast<size_t>(n) * n) : 0;
    encoder.dispatch([pa = a.data<float>(), po = out.data<float>(), n, count]() {
      const int ldx = (n + L - 1) / L * L;
      const int parts = static_cast<int>(std::min<size_t>(pool().size(), count));
      pool().run(
          [&](int part, int parts) {
            std::vector<float> x(static_cast<size_t>(n) * ldx);
            for (size_t m = count * part / parts; m < count * (part + 1) / parts; ++m) {
              const size_t at = m * n * n;
              unit_lower_inverse_one(pa + at, x.data(), n, ldx, po + at);
            }
          },
          std::max(parts, 1));
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.unit_lower_inverse] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlUnitLowerInverse";
  }

  bool is_equivalent(const Primitive&) const override {
    return true;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.gated_delta_rows] " + what);
  }
}

std::string dims(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  return out.str() + "]";
}

std::string dims(const array& a) {
  return dims(a.shape());
}

// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; states: arrays [b_i, Hv, Dv, Dk]
// whose b_i add up to B, all float32. Returns [y [B, T, Hv, Dv], the states after the T steps].
std::vector<array> gated_delta_rows(const array& q, const array& k, const array& v,
                                    const array& g, const array& beta,
                                    const std::vector<array>& states) {
  for (const array* a : {&q, &k, &v, &g, &beta}) {
    check(a->dtype() == float32, "q, k, v, g and beta must be float32");
  }
  check(q.ndim() == 4 && k.shape() == q.shape(), "q and k must be [B, T, Hk, Dk], got q " +
                                                     dims(q) + ", k " + dims(k));
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  check(v.ndim() == 4 && v.shape(0) == B && v.shape(1) == T,
        "v must be [B, T, Hv, Dv] with q's B, T; got v " + dims(v) + ", q " + dims(q));
  const int Hv = v.shape(2), Dv = v.shape(3);
  check(Hk > 0 && Hv % Hk == 0, "Hv (" + std::to_string(Hv) + ") must be a multiple of Hk (" +
                                    std::to_string(Hk) + ")");
  const Shape per_head{B, T, Hv};
  check(g.shape() == per_head && beta.shape() == per_head,
        "g and beta must be [B, T, Hv] = " + dims(per_head) + ", got " + dims(g) + " and " +
            dims(beta));
  Stream s = default_stream(Device::cpu);
  std::vector<array> inputs;
  for (const array* a : {&q, &k, &v, &g, &beta}) {
    inputs.push_back(contiguous(*a, false, s));
  }
  std::vector<int> rows;
  std::vector<Shape> shapes{v.shape()};
  std::vector<Dtype> dtypes{float32};
  int total = 0;
  for (const array& state : states) {
    check(state.dtype() == float32, "every state must be float32");
    check(state.ndim() == 4 && state.shape(1) == Hv && state.shape(2) == Dv &&
              state.shape(3) == Dk,
          "a state must be [rows, Hv, Dv, Dk] = [rows, " + std::to_string(Hv) + ", " +
              std::to_string(Dv) + ", " + std::to_string(Dk) + "], got " + dims(state));
    rows.push_back(state.shape(0));
    total += state.shape(0);
    inputs.push_back(contiguous(state, false, s));
    shapes.push_back(state.shape());
    dtypes.push_back(float32);
  }
  check(total == B, "the states hold " + std::to_string(total) + " rows, q has B = " +
                        std::to_string(B));
  return array::make_arrays(std::move(shapes), dtypes,
                            std::make_shared<GatedDeltaRows>(s, Shapes{B, T, Hk, Hv, Dk, Dv},
                                                             std::move(rows)),
                            inputs);
}

array unit_lower_inverse(const array& a) {
  if (a.dtype() != float32 || a.ndim() < 2 || a.shape(-1) != a.shape(-2) ||
      a.shape(-1) > 64 * L) {
    throw std::invalid_argument(
        "[chatml.unit_lower_inverse] takes float32 matrices [..., n, n] with n <= " +
        std::to_string(64 * L) + ", got " + dims(a) +
        (a.dtype() == float32 ? "" : " (not float32)"));
  }
  Stream s = default_stream(Device::cpu);
  return array(a.shape(), float32, std::make_shared<UnitLowerInverse>(s), {a});
}

}  // namespace

void bind_delta(nb::module_& m) {
  m.def("gated_delta_rows", &gated_delta_rows, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("g"), nb::arg("beta"), nb::arg("states"),
        "The gated delta rule for T tokens of B rows, one pass over each state row (CPU, "
        "float32): [y, *states after].");
  m.def("unit_lower_inverse", &unit_lower_inverse, nb::arg("a"),
        "Inverse of unit lower-triangular matrices [..., n, n] by forward substitution (CPU, "
        "float32; reads the strict lower triangle).");
}

}  // namespace chatml
