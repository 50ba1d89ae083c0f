// Vectorized activations for a prefill on the CPU: silu and sigmoid gates, and the Gated
// DeltaNet's causal conv with its silu, as MLX primitives.
//
// MLX's CPU backend computes exp one float at a time on x86, about 80 M/s: a 512-token
// prefill of the 0.8B build spends a third of its time there (silu over the conv outputs and
// the MLP, the attention's sigmoid gate). Here exp is vexp.h's, on whole SIMD vectors, a few
// G/s, and each product (silu(a) * b, y * sigmoid(g)) is fused into the same pass. Large
// arrays split over the thread pool of the GEMV kernels.
//
// Accuracy: exp within ~2 ulp (vexp.h), so silu and sigmoid match a float64 reference to
// ~1e-7 relative; kernels/native.py keeps MLX's ops for other dtypes and devices.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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

using namespace simd;

enum class Op { kExp, kSilu, kSiluMul, kMulSigmoid };

// out[i] = f(a[i], b[i]) over [begin, end).
void apply(Op op, const float* a, const float* b, float* out, size_t begin, size_t end) {
  size_t i = begin;
  switch (op) {
    case Op::kExp:
      for (; i + L <= end; i += L) {
        store(out + i, exp(load(a + i)));
      }
      for (; i < end; ++i) {
        out[i] = exp1(a[i]);
      }
      break;
    case Op::kSilu:
      for (; i + L <= end; i += L) {
        const vf x = load(a + i);
        store(out + i, x * sigmoid(x));
      }
      for (; i < end; ++i) {
        out[i] = a[i] / (1.0f + exp1(-a[i]));
      }
      break;
    case Op::kSiluMul:
      for (; i + L <= end; i += L) {
        const vf x = load(a + i);
        store(out + i, x * sigmoid(x) * load(b + i));
      }
      for (; i < end; ++i) {
        out[i] = a[i] / (1.0f + exp1(-a[i])) * b[i];
      }
      break;
    case Op::kMulSigmoid:
      for (; i + L <= end; i += L) {
        store(out + i, load(a + i) * sigmoid(load(b + i)));
      }
      for (; i < end; ++i) {
        out[i] = a[i] / (1.0f + exp1(-b[i]));
      }
      break;
  }
}

// range(lo, hi) over [0, n) split over the pool, in parts of whole vectors of at least 16 K
// floats (a smaller array is not worth a wake-up).
template <typename F>
void parallel(size_t n, F&& range) {
  const size_t grain = 16384;
  const size_t most = std::max<size_t>(1, n / grain);
  const int parts = static_cast<int>(std::min<size_t>(pool().size(), most));
  const size_t per = ((n + parts - 1) / parts + L - 1) / L * L;
  pool().run([&](int part, int) { range(std::min(n, part * per), std::min(n, (part + 1) * per)); },
             parts);
}

class Elementwise : public Primitive {
 public:
  Elementwise(Stream stream, Op op) : Primitive(stream), op_(op) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    array& out = outputs[0];
    const array a = read_into(inputs[0], out, encoder);
    encoder.set_output_array(out);
    const float* pb = inputs.size() > 1 ? row_major(inputs[1], encoder).data<float>() : nullptr;
    const float* pa = a.data<float>();
    encoder.dispatch([op = op_, pa, pb, po = out.data<float>(), n = out.size()]() {
      parallel(n, [&](size_t lo, size_t hi) { apply(op, pa, pb, po, lo, hi); });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.activation] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlActivation";
  }

  bool is_equivalent(const Primitive& other) const override {
    return op_ == static_cast<const Elementwise&>(other).op_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Op op_;
};

// The causal depthwise conv of a Gated DeltaNet layer and its silu, for one output row:
// o[c] = silu(sum_j tap[j][c] * wt[j][c]), summed for j = 0..K-1 in float32 in that order (the
// order of the multiply-adds in engine/runtime/model.py). tap[j] is the input row at tap j
// (of the window: positions t..t+K-1); wt is the weight transposed to [K, C], so the inner
// loop reads it as vectors.
void conv_row(const float* const* tap, const float* wt, float* o, int C, int K) {
  int c = 0;
  for (; c + L <= C; c += L) {
    vf s = load(tap[0] + c) * load(wt + c);
    for (int j = 1; j < K; ++j) {
      s = s + load(tap[j] + c) * load(wt + static_cast<size_t>(j) * C + c);
    }
    store(o + c, s * sigmoid(s));
  }
  for (; c < C; ++c) {
    float s = tap[0][c] * wt[c];
    for (int j = 1; j < K; ++j) {
      s += tap[j][c] * wt[static_cast<size_t>(j) * C + c];
    }
    o[c] = s / (1.0f + exp1(-s));
  }
}

std::vector<float> transposed(const float* w, int C, int K) {  // [C, K] -> [K, C]
  std::vector<float> wt(static_cast<size_t>(K) * C);
  for (int c = 0; c < C; ++c) {
    for (int j = 0; j < K; ++j) {
      wt[static_cast<size_t>(j) * C + c] = w[static_cast<size_t>(c) * K + j];
    }
  }
  return wt;
}

// Rows of B * C floats or more split over the pool; small ones are not worth a wake-up.
int parts_for_rows(size_t rows, int C) {
  const size_t most = rows * C < 16384 ? 1 : rows;
  return static_cast<int>(std::min<size_t>(pool().size(), most));
}

// The conv over a chunk: out [B, T, C] from the window [B, K-1+T, C] (the conv tail, then the
// chunk's inputs) and weight [C, K].
class ConvSilu : public Primitive {
 public:
  explicit ConvSilu(Stream stream) : Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(inputs[1]);
    const array window = row_major(inputs[0], encoder);
    const array weight = row_major(inputs[1], encoder);
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    const int B = out.shape(0), T = out.shape(1), C = out.shape(2), K = weight.shape(1);
    encoder.dispatch([x = window.data<float>(), w = weight.data<float>(), y = out.data<float>(),
                      B, T, C, K]() {
      const std::vector<float> wt = transposed(w, C, K);
      const size_t rows = static_cast<size_t>(B) * T;
      auto job = [&](int part, int parts) {
        std::vector<const float*> tap(K);
        for (size_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r) {
          const size_t b = r / T, t = r % T;
          for (int j = 0; j < K; ++j) {
            tap[j] = x + (b * (T + K - 1) + t + j) * C;
          }
          conv_row(tap.data(), wt.data(), y + r * C, C, K);
        }
      };
      pool().run(job, parts_for_rows(rows, C));
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.conv_silu] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlConvSilu";
  }

  bool is_equivalent(const Primitive&) const override {
    return true;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    const Shape& w = inputs[0].shape();
    return {{w[0], w[1] - inputs[1].shape(1) + 1, w[2]}};
  }
};

// The conv for one token of B rows whose conv tails are separate arrays, as in a batched
// decode step where each sequence keeps its own: x [B, C] (each row's new input), weight
// [C, K], tails [b_i, K-1, C] (b_i adding up to B). Outputs: y [B, C], then each row's tail
// after the token (its last K-2 inputs and x), one array per tail. The window [tail, x] is
// never built: a batch of such steps used to stack the tails, join x to them and copy the new
// tails out again, three copies of every tail per layer and token. A tail nobody else holds
// (a snapshot shares the old one) is overwritten in place. y is conv_row's, as ConvSilu's.
class ConvSiluRows : public Primitive {
 public:
  explicit ConvSiluRows(Stream stream) : Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    const array x = row_major(inputs[0], encoder);
    const array weight = row_major(inputs[1], encoder);
    outputs[0].set_data(allocator::malloc(outputs[0].nbytes()));
    const int C = x.shape(1), K = weight.shape(1);
    const size_t per_row = static_cast<size_t>(K - 1) * C;
    std::vector<const float*> in;
    std::vector<float*> out;
    for (size_t i = 2; i < inputs.size(); ++i) {
      array& next = outputs[i - 1];
      const array tail = read_into(inputs[i], next, encoder);
      for (int b = 0; b < tail.shape(0); ++b) {
        in.push_back(tail.data<float>() + b * per_row);
        out.push_back(next.data<float>() + b * per_row);
      }
    }
    for (array& a : outputs) {
      encoder.set_output_array(a);
    }
    encoder.dispatch([px = x.data<float>(), w = weight.data<float>(),
                      y = outputs[0].data<float>(), in = std::move(in), out = std::move(out), C,
                      K]() {
      const std::vector<float> wt = transposed(w, C, K);
      const size_t rows = in.size();
      auto job = [&](int part, int parts) {
        std::vector<const float*> tap(K);
        for (size_t b = rows * part / parts; b < rows * (part + 1) / parts; ++b) {
          const float* xb = px + b * C;
          for (int j = 0; j < K - 1; ++j) {
            tap[j] = in[b] + static_cast<size_t>(j) * C;
          }
          tap[K - 1] = xb;
          conv_row(tap.data(), wt.data(), y + b * C, C, K);
          // The tail moves up one input (in place when out[b] is in[b]: memmove) and takes x.
          std::memmove(out[b], in[b] + C, sizeof(float) * (K - 2) * C);
          std::memcpy(out[b] + static_cast<size_t>(K - 2) * C, xb, sizeof(float) * C);
        }
      };
      pool().run(job, parts_for_rows(rows, C));
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.conv_silu_rows] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlConvSiluRows";
  }

  bool is_equivalent(const Primitive&) const override {
    return true;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    std::vector<Shape> shapes{inputs[0].shape()};
    for (size_t i = 2; i < inputs.size(); ++i) {
      shapes.push_back(inputs[i].shape());
    }
    return shapes;
  }
};

// Softmax over the last axis of causal attention scores [..., T, S] whose T queries are the
// last T of the S positions: row i sees keys 0..S-T+i, the rest of its row becomes 0. Each row
// in float32: its max, exp(x - max) with the vectorized exp, the sum, then a scale.
class CausalSoftmax : public Primitive {
 public:
  explicit CausalSoftmax(Stream stream) : Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    array& out = outputs[0];
    const array x = read_into(inputs[0], out, encoder);
    encoder.set_output_array(out);
    const int S = x.shape(-1), T = x.shape(-2);
    const size_t rows = x.size() / S;
    encoder.dispatch([in = x.data<float>(), o = out.data<float>(), S, T, rows]() {
      auto job = [&](int part, int parts) {
        for (size_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r) {
          const int n = S - T + static_cast<int>(r % T) + 1;  // keys this query sees
          softmax_row(in + r * S, o + r * S, n, S);
        }
      };
      pool().run(job, parts_for_rows(rows, S));
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.causal_softmax] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlCausalSoftmax";
  }

  bool is_equivalent(const Primitive&) const override {
    return true;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
};

void check(bool ok, const char* fn, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument(std::string("[chatml.") + fn + "] " + what);
  }
}

array elementwise(Op op, const char* fn, const std::vector<array>& args) {
  for (const array& a : args) {
    check(a.dtype() == float32, fn, "takes float32 arrays");
    check(a.shape() == args[0].shape(), fn, "takes arrays of one shape (no broadcasting)");
  }
  Stream s = default_stream(Device::cpu);
  return array(args[0].shape(), float32, std::make_shared<Elementwise>(s, op), args);
}

array conv_silu(const array& window, const array& weight) {
  check(window.dtype() == float32 && weight.dtype() == float32, "conv_silu",
        "takes float32 arrays");
  check(window.ndim() == 3 && weight.ndim() == 2 && weight.shape(0) == window.shape(2) &&
            weight.shape(1) >= 1 && window.shape(1) >= weight.shape(1),
        "conv_silu", "takes window [B, K-1+T, C] and weight [C, K] with T >= 1");
  Stream s = default_stream(Device::cpu);
  Shape shape{window.shape(0), window.shape(1) - weight.shape(1) + 1, window.shape(2)};
  return array(shape, float32, std::make_shared<ConvSilu>(s), {window, weight});
}

std::vector<array> conv_silu_rows(const array& x, const array& weight,
                                  const std::vector<array>& tails) {
  check(x.dtype() == float32 && weight.dtype() == float32, "conv_silu_rows",
        "takes float32 arrays");
  check(x.ndim() == 2 && weight.ndim() == 2 && weight.shape(0) == x.shape(1) &&
            weight.shape(1) >= 2,
        "conv_silu_rows", "takes x [B, C] and weight [C, K] with K >= 2");
  const int K = weight.shape(1), C = x.shape(1);
  int rows = 0;
  std::vector<array> inputs{x, weight};
  std::vector<Shape> shapes{x.shape()};
  for (const array& t : tails) {
    check(t.dtype() == float32 && t.ndim() == 3 && t.shape(1) == K - 1 && t.shape(2) == C,
          "conv_silu_rows",
          "takes float32 tails [rows, K-1, C] = [rows, " + std::to_string(K - 1) + ", " +
              std::to_string(C) + "]");
    rows += t.shape(0);
    inputs.push_back(t);
    shapes.push_back(t.shape());
  }
  check(rows == x.shape(0), "conv_silu_rows",
        "the tails hold " + std::to_string(rows) + " rows, x has B = " +
            std::to_string(x.shape(0)));
  Stream s = default_stream(Device::cpu);
  return array::make_arrays(std::move(shapes), std::vector<Dtype>(inputs.size() - 1, float32),
                            std::make_shared<ConvSiluRows>(s), inputs);
}

array causal_softmax(const array& scores) {
  check(scores.dtype() == float32, "causal_softmax", "takes float32 scores");
  check(scores.ndim() >= 2 && scores.shape(-2) <= scores.shape(-1) && scores.shape(-2) > 0,
        "causal_softmax", "takes scores [..., T, S] with 0 < T <= S");
  Stream s = default_stream(Device::cpu);
  return array(scores.shape(), float32, std::make_shared<CausalSoftmax>(s), {scores});
}

}  // namespace

void bind_activations(nb::module_& m) {
  m.def("exp", [](const array& x) { return elementwise(Op::kExp, "exp", {x}); },
        nb::arg("x"), "exp(x) (CPU, float32; 0 below -87.3).");
  m.def("silu", [](const array& x) { return elementwise(Op::kSilu, "silu", {x}); },
        nb::arg("x"), "x * sigmoid(x) (CPU, float32).");
  m.def("silu_mul",
        [](const array& a, const array& b) {
          return elementwise(Op::kSiluMul, "silu_mul", {a, b});
        },
        nb::arg("a"), nb::arg("b"), "silu(a) * b (CPU, float32, same shapes).");
  m.def("mul_sigmoid",
        [](const array& y, const array& g) {
          return elementwise(Op::kMulSigmoid, "mul_sigmoid", {y, g});
        },
        nb::arg("y"), nb::arg("g"), "y * sigmoid(g) (CPU, float32, same shapes).");
  m.def("causal_softmax", &causal_softmax, nb::arg("scores"),
        "Softmax over the last axis of scores [..., T, S] for the last T of S positions, "
        "causally masked (CPU, float32).");
  m.def("conv_silu", &conv_silu, nb::arg("window"), nb::arg("weight"),
        "silu of the causal depthwise conv: window [B, K-1+T, C], weight [C, K] -> [B, T, C].");
  m.def("conv_silu_rows", &conv_silu_rows, nb::arg("x"), nb::arg("weight"), nb::arg("tails"),
        "conv_silu for one token of B rows, each row's conv tail its own array: x [B, C], "
        "weight [C, K], tails [b_i, K-1, C] -> [y [B, C], *tails after the token].");
}

}  // namespace chatml
