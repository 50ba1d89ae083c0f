// Attention of a few queries per row over each row's own KV cache, as one MLX primitive: a
// decode step's attention (one query per row) or a short verify pass's, every row of a batch
// in one pass, each over its cache's buffer as it lies.
//
// MLX's CPU scaled_dot_product_attention reads a [1, 2, 1024, 256] cache for one query at
// ~5 GB/s (0.87 ms; two matmuls around a softmax with a scalar exp), and a batched step ran it
// once per row. Here each (row, key head) is one task for the pool's threads:
//   1. the scores: the query heads of the key head and their T queries, scaled by MLX's rule
//      (q * scale first), each as a float32 dot product with every key the row holds; the
//      queries share each key's loads;
//   2. the causal softmax of each query over the keys it sees (query t of T sees the first
//      n - T + t + 1 of the row's n keys): vexp.h's softmax_row, the one a prefill's
//      causal_softmax (activations.cpp) runs;
//   3. the probabilities times v, key by key, in blocks of keys that stay in L1/L2 while the
//      blocks of the output columns pass over them.
// Keys and values are read in place from each row's buffer [1, Hkv, capacity, D]: rows of
// different lengths go together without a copy, a pad or a mask.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
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

using simd::hsum;
using simd::L;
using simd::load;
using simd::splat;
using simd::store;
using simd::vf;

constexpr int kQueries = 4;  // queries per register tile (scores and output)
// Output columns per tile of the weighted sum: kQueries * kColumnVecs accumulators.
constexpr int kColumnVecs = L == 16 ? 4 : 2;
constexpr int kKeyBlock = 64;  // keys per block of the weighted sum (64 KiB of v at D = 256)

// One key head of one row.
struct Task {
  const float* q;  // [Q][Dk]: the query heads of this key head, T queries each
  const float* k;  // [n][Dk]
  const float* v;  // [n][Dv]
  float* out;      // [Q][Dv]
  int n;           // keys the row holds
};

// s[i][j] = scale * q_i . k_j for QB queries and every key j < n (row stride lds).
template <int QB>
void scores(const float* q, const float* k, int n, int D, float* s, size_t lds) {
  const int dv = D / L * L;
  for (int j = 0; j < n; ++j) {
    const float* kj = k + static_cast<size_t>(j) * D;
    vf acc[QB];
#pragma GCC unroll 4
    for (int i = 0; i < QB; ++i) {
      acc[i] = vf{};
    }
    for (int d = 0; d < dv; d += L) {
      const vf kv = load(kj + d);
#pragma GCC unroll 4
      for (int i = 0; i < QB; ++i) {
        acc[i] += load(q + i * D + d) * kv;
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < QB; ++i) {
      float dot = hsum(acc[i]);
      for (int d = dv; d < D; ++d) {
        dot += q[i * D + d] * kj[d];
      }
      s[i * lds + j] = dot;
    }
  }
}

// out[i][c0, c0 + CV * L) += sum over keys [j0, j1) of p[i][j] * v_j, for QB queries.
template <int QB, int CV>
void weigh(const float* p, size_t ldp, const float* v, int Dv, int j0, int j1, int c0,
           float* out) {
  vf acc[QB][CV];
#pragma GCC unroll 4
  for (int i = 0; i < QB; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) {
      acc[i][c] = load(out + i * Dv + c0 + c * L);
    }
  }
  for (int j = j0; j < j1; ++j) {
    const float* vj = v + static_cast<size_t>(j) * Dv + c0;
    vf vv[CV];
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) {
      vv[c] = load(vj + c * L);
    }
#pragma GCC unroll 4
    for (int i = 0; i < QB; ++i) {
      const vf pi = splat(p[i * ldp + j]);
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) {
        acc[i][c] += pi * vv[c];
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < QB; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) {
      store(out + i * Dv + c0 + c * L, acc[i][c]);
    }
  }
}

template <int QB>
void weigh_all(const float* p, size_t ldp, const float* v, int Dv, int n, float* out) {
  std::fill(out, out + QB * Dv, 0.0f);
  constexpr int kTile = kColumnVecs * L;
  const int tiled = Dv / kTile * kTile, vectors = Dv / L * L;
  for (int j0 = 0; j0 < n; j0 += kKeyBlock) {
    const int j1 = std::min(n, j0 + kKeyBlock);
    int c = 0;
    for (; c < tiled; c += kTile) {
      weigh<QB, kColumnVecs>(p, ldp, v, Dv, j0, j1, c, out);
    }
    for (; c < vectors; c += L) {
      weigh<QB, 1>(p, ldp, v, Dv, j0, j1, c, out);
    }
    for (; c < Dv; ++c) {  // columns past the last whole vector
      for (int i = 0; i < QB; ++i) {
        float sum = out[i * Dv + c];
        for (int j = j0; j < j1; ++j) {
          sum += p[i * ldp + j] * v[static_cast<size_t>(j) * Dv + c];
        }
        out[i * Dv + c] = sum;
      }
    }
  }
}

using ScoresFn = void (*)(const float*, const float*, int, int, float*, size_t);
using WeighFn = void (*)(const float*, size_t, const float*, int, int, float*);
constexpr ScoresFn kScores[] = {nullptr, scores<1>, scores<2>, scores<3>, scores<4>};
constexpr WeighFn kWeigh[] = {nullptr, weigh_all<1>, weigh_all<2>, weigh_all<3>, weigh_all<4>};

// One task: Q = heads * T queries, query i (head i / T, query i % T) sees n - T + i % T + 1
// keys. `qs` and `p` are the calling thread's scratch.
void attend(const Task& t, int Q, int T, int Dk, int Dv, float scale, std::vector<float>& qs,
            std::vector<float>& p) {
  qs.resize(static_cast<size_t>(Q) * Dk);
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i] = t.q[i] * scale;
  }
  const size_t ldp = (static_cast<size_t>(t.n) + L - 1) / L * L;
  p.resize(static_cast<size_t>(Q) * ldp);
  for (int j0 = 0; j0 < t.n; j0 += kKeyBlock) {  // each block of keys meets every query
    const int j1 = std::min(t.n, j0 + kKeyBlock);
    for (int i0 = 0; i0 < Q; i0 += kQueries) {
      const int qb = std::min(kQueries, Q - i0);
      kScores[qb](qs.data() + static_cast<size_t>(i0) * Dk, t.k + static_cast<size_t>(j0) * Dk,
                  j1 - j0, Dk, p.data() + i0 * ldp + j0, ldp);
    }
  }
  for (int i = 0; i < Q; ++i) {
    simd::softmax_row(p.data() + i * ldp, p.data() + i * ldp, t.n - T + i % T + 1, t.n);
  }
  for (int i0 = 0; i0 < Q; i0 += kQueries) {
    const int qb = std::min(kQueries, Q - i0);
    kWeigh[qb](p.data() + i0 * ldp, ldp, t.v, Dv, t.n, t.out + static_cast<size_t>(i0) * Dv);
  }
}

class AttentionRows : public UnaryPrimitive {
 public:
  AttentionRows(Stream stream, std::vector<int> lengths, float scale)
      : UnaryPrimitive(stream), lengths_(std::move(lengths)), scale_(scale) {}

  // inputs: q [B, Hq, T, Dk], then B key buffers [1, Hkv, capacity_b, Dk], then B value
  // buffers [1, Hkv, capacity_b, Dv]; out [B, Hq, T, Dv].
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    out.set_data(allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    const array q = row_major(inputs[0], encoder);
    const int B = q.shape(0), Hq = q.shape(1), T = q.shape(2), Dk = q.shape(3);
    const int Hkv = inputs[1].shape(1), Dv = out.shape(3), group = Hq / Hkv;
    std::vector<Task> tasks;
    for (int b = 0; b < B; ++b) {
      const array kb = row_major(inputs[1 + b], encoder);  // held by the encoder if a copy
      const array vb = row_major(inputs[1 + B + b], encoder);
      const size_t capacity = kb.shape(2);
      for (int h = 0; h < Hkv; ++h) {
        const size_t head = static_cast<size_t>(b) * Hq + static_cast<size_t>(h) * group;
        tasks.push_back({q.data<float>() + head * T * Dk,
                         kb.data<float>() + h * capacity * Dk,
                         vb.data<float>() + h * capacity * Dv,
                         out.data<float>() + head * T * Dv, lengths_[b]});
      }
    }
    encoder.dispatch([tasks = std::move(tasks), Q = group * T, T, Dk, Dv, scale = scale_]() {
      auto job = [&](int part, int parts) {
        std::vector<float> qs, p;
        for (size_t i = part; i < tasks.size(); i += parts) {
          attend(tasks[i], Q, T, Dk, Dv, scale, qs, p);
        }
      };
      // One part a task: the pool's threads claim them as they finish (rows differ in length).
      pool().run(job, static_cast<int>(tasks.size()));
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[chatml.attention_rows] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlAttentionRows";
  }

  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const AttentionRows&>(other);
    return lengths_ == o.lengths_ && scale_ == o.scale_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape s = inputs[0].shape();
    s.back() = inputs[1 + s[0]].shape(3);  // the first value buffer's Dv
    return {s};
  }

 private:
  std::vector<int> lengths_;
  float scale_;
};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.attention_rows] " + what);
  }
}

array attention_rows(const array& q, const std::vector<array>& keys,
                     const std::vector<array>& values, const std::vector<int>& lengths,
                     float scale) {
  check(q.dtype() == float32 && q.ndim() == 4, "q must be a float32 array [B, Hq, T, D]");
  const int B = q.shape(0), Hq = q.shape(1), T = q.shape(2), Dk = q.shape(3);
  check(B > 0 && T > 0 && Dk > 0 && Hq > 0, "q must not be empty");
  check(static_cast<int>(keys.size()) == B && static_cast<int>(values.size()) == B &&
            static_cast<int>(lengths.size()) == B,
        "takes one key buffer, one value buffer and one length per row of q");
  const int Hkv = keys[0].ndim() == 4 ? keys[0].shape(1) : 0;
  check(Hkv > 0 && Hq % Hkv == 0, "the query heads must be a multiple of the key heads");
  const int Dv = values[0].ndim() == 4 ? values[0].shape(3) : 0;
  for (int b = 0; b < B; ++b) {
    const array &k = keys[b], &v = values[b];
    std::ostringstream row;
    row << "row " << b << ": ";
    check(k.dtype() == float32 && v.dtype() == float32 && k.ndim() == 4 && v.ndim() == 4,
          row.str() + "keys and values must be float32 arrays [1, Hkv, capacity, D]");
    check(k.shape(0) == 1 && v.shape(0) == 1 && k.shape(1) == Hkv && v.shape(1) == Hkv &&
              k.shape(3) == Dk && v.shape(3) == Dv && k.shape(2) == v.shape(2),
          row.str() + "keys [1, Hkv, capacity, D] and values [1, Hkv, capacity, Dv] must match "
                      "q and the first row");
    std::ostringstream n;
    n << row.str() << "its length " << lengths[b] << " must be at least T (" << T
      << ") and at most the buffer's capacity (" << k.shape(2) << ")";
    check(lengths[b] >= T && lengths[b] <= k.shape(2), n.str());
  }
  check(Dv > 0, "values must not be empty");
  std::vector<array> inputs{q};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  Stream s = default_stream(Device::cpu);
  return array(Shape{B, Hq, T, Dv}, float32, std::make_shared<AttentionRows>(s, lengths, scale),
               std::move(inputs));
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("attention_rows", &attention_rows, nb::arg("q"), nb::arg("keys"), nb::arg("values"),
        nb::arg("lengths"), nb::arg("scale"),
        "Causal attention of q [B, Hq, T, D] (each row's queries the last T of its positions) "
        "over keys[b][:, :, :lengths[b]] and values[b][...] (the rows' cache buffers "
        "[1, Hkv, capacity, D]), q scaled first: [B, Hq, T, Dv] (CPU, float32).");
}

}  // namespace chatml
