// A sampled token picked on the CPU: temperature, the top-k, min-p and top-p cuts and the
// draw, for each row of logits [..., V], as one MLX primitive.
//
// MLX's ops make a dozen passes over the vocabulary for one pick with Qwen's recommended cuts
// (top_k 20, top_p 0.95): a partition for the k-th largest, masks, a softmax (its exp scalar
// on x86), a second partition for top-p, and a categorical draw over all 248,320 entries
// (Gumbel noise for each): ~8.5 ms a token on one core. Here one vectorized pass divides by
// the temperature and keeps the few values at or above a rising threshold; everything after
// works on those survivors: ~0.1 ms.
//
// The cuts are engine/runtime/sampling.py's `Sampler.final_logits`, value for value:
//   l = logits / temperature (float32 division);
//   top_k: keep l >= the k-th largest l (tokens tied with it stay);
//   p = softmax over what is kept; min_p: keep p >= min_p * max(p);
//   top_p: over the k largest p (all, without top_k) sorted in descending order, tau is the
//   smallest value whose predecessors' float32 running sum is below top_p; keep p >= tau
//   (min-p and top-p both look at p before either cut).
// The draw is by inverse CDF in index order: the first kept token whose running weight
// exp(l - max) exceeds u times the kept total, u uniform in [0, 1) (drawn by MLX from the
// row's key). That is the distribution of a categorical draw over the cut logits; a given u
// picks what the float64 reference picks, up to float32 rounding at the boundaries.
//
// `sample_rows` takes the rows as arrays of their own: a batched step's rows are picked in one
// pass over the pool's threads without a copy into one [n, V] array.
//
// `sample_excluding` also leaves one token per row out of the draw and returns the
// probability the cut distribution gives it: speculative sampling's verify (accept a draft d
// with probability p(d), else draw from p without d).
//
// -inf logits (a grammar's mask) are never picked; a row whose logits are all -inf gives 0.
//
// `logprobs` reports what callers ask for with a token (OpenAI's logprobs): log_softmax of
// the raw logits at the token and the top k, in the same kind of passes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
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

struct Cuts {
  float temperature;
  int top_k;  // 0: none
  float top_p;  // 1: none
  float min_p;  // 0: none

  bool operator==(const Cuts& o) const {
    return temperature == o.temperature && top_k == o.top_k && top_p == o.top_p &&
           min_p == o.min_p;
  }
};

// One row's survivors, in index order: scaled logits and their token ids.
struct Kept {
  std::vector<float> l;
  std::vector<uint32_t> id;
};

struct Entry {
  float l;
  uint32_t id;
};

// Drop the candidates below the k-th largest (ties with it stay); returns that value.
float prune(std::vector<Entry>& c, int k) {
  std::nth_element(c.begin(), c.begin() + (k - 1), c.end(),
                   [](const Entry& a, const Entry& b) { return a.l > b.l; });
  const float kth = c[k - 1].l;
  c.erase(std::remove_if(c.begin(), c.end(), [kth](const Entry& e) { return e.l < kth; }),
          c.end());
  return kth;
}

// Every finite scaled logit at or above the k-th largest. One vectorized pass: a value is
// looked at only when it reaches the threshold, which rises as candidates pile up.
void top_k(const float* x, int V, float temperature, int k, Kept& out) {
  std::vector<Entry> c;
  size_t cap = std::max<size_t>(1024, 8 * static_cast<size_t>(k));
  c.reserve(cap + L);
  float t = -INFINITY;
  const vf div = splat(temperature);
  auto admit = [&](float l, uint32_t i) {
    if (l >= t && l > -INFINITY) {
      c.push_back({l, i});
    }
  };
  int i = 0;
  for (; i + L <= V; i += L) {
    const vf l = load(x + i) / div;
    const vi hit = l >= splat(t);
    bool any = false;
    for (int j = 0; j < L; ++j) {
      any |= hit[j] != 0;
    }
    if (!any) {
      continue;
    }
    for (int j = 0; j < L; ++j) {
      admit(l[j], static_cast<uint32_t>(i + j));
    }
    if (c.size() >= cap) {
      t = prune(c, k);
      cap = std::max(cap, 2 * c.size());  // many ties: grow rather than prune again at once
    }
  }
  for (; i < V; ++i) {
    admit(x[i] / temperature, static_cast<uint32_t>(i));
  }
  if (static_cast<int>(c.size()) > k) {
    prune(c, k);
  }
  std::sort(c.begin(), c.end(), [](const Entry& a, const Entry& b) { return a.id < b.id; });
  out.l.resize(c.size());
  out.id.resize(c.size());
  for (size_t j = 0; j < c.size(); ++j) {
    out.l[j] = c[j].l;
    out.id[j] = c[j].id;
  }
}

// Every scaled logit (no top-k cut), in one vectorized pass: -inf and NaN stay as -inf, whose
// weight exp(-inf) is 0, so they are never drawn.
void all(const float* x, int V, float temperature, Kept& out) {
  out.l.resize(V);
  out.id.resize(V);
  const vf div = splat(temperature), minus_inf = splat(-INFINITY);
  int i = 0;
  for (; i + L <= V; i += L) {
    const vf l = load(x + i) / div;
    store(out.l.data() + i, l == l ? l : minus_inf);
  }
  for (; i < V; ++i) {
    const float l = x[i] / temperature;
    out.l[i] = l == l ? l : -INFINITY;
  }
  for (i = 0; i < V; ++i) {
    out.id[i] = static_cast<uint32_t>(i);
  }
}

// With `w`, w = exp(a - max) and their sum (in double, from float lanes of at most 256
// terms each); max_of is vexp.h's.
double exp_sum(const float* a, size_t n, float m, float* w) {
  double sum = 0.0;
  vf sv = {};
  size_t i = 0;
  for (; i + L <= n; i += L) {
    const vf e = exp(load(a + i) - splat(m));
    if (w != nullptr) {
      store(w + i, e);
    }
    sv += e;
    if ((i / L) % 256 == 255) {
      for (int j = 0; j < L; ++j) {
        sum += sv[j];
      }
      sv = vf{};
    }
  }
  for (int j = 0; j < L; ++j) {
    sum += sv[j];
  }
  for (; i < n; ++i) {
    const float e = exp1(a[i] - m);
    if (w != nullptr) {
      w[i] = e;
    }
    sum += e;
  }
  return sum;
}

// top-p's tau over probabilities w / sum (w = exp(l - max)): the `limit` largest, in
// descending order, summed in float32; tau is the smallest one whose predecessors hold less
// than top_p. Only a prefix is ordered (selected, then sorted), four times longer each time
// it falls short.
float top_p_tau(const std::vector<float>& w, double sum, size_t limit, float top_p) {
  std::vector<float> p(w.size());
  for (size_t j = 0; j < w.size(); ++j) {
    p[j] = static_cast<float>(w[j] / sum);
  }
  limit = std::min(limit, p.size());
  for (size_t m = std::min<size_t>(64, limit);; m = std::min(limit, 4 * m)) {
    std::nth_element(p.begin(), p.begin() + (m - 1), p.end(), std::greater<float>());
    std::sort(p.begin(), p.begin() + m, std::greater<float>());
    float c = 0.0f, tau = INFINITY;
    bool reached = false;
    for (size_t j = 0; j < m; ++j) {
      c += p[j];
      if (c - p[j] < top_p) {
        tau = std::min(tau, p[j]);
      } else {
        reached = true;
        break;
      }
    }
    if (reached || m == limit) {
      return tau;
    }
  }
}

// One row's token. With `exclude` (a token id, or -1) that token is left out of the draw
// (the rest renormalized) and `*p_excluded` gets the probability the cut distribution gives
// it: speculative sampling's residual draw for a rejected draft.
uint32_t pick(const float* x, int V, float u, const Cuts& cuts, int64_t exclude = -1,
              float* p_excluded = nullptr) {
  if (p_excluded != nullptr) {
    *p_excluded = 0.0f;
  }
  Kept kept;
  if (cuts.top_k > 0 && cuts.top_k < V) {
    top_k(x, V, cuts.temperature, cuts.top_k, kept);
  } else {
    all(x, V, cuts.temperature, kept);
  }
  const size_t n = kept.l.size();
  const float m = n ? max_of(kept.l.data(), n) : -INFINITY;
  if (m == -INFINITY) {
    return 0;  // every logit -inf: nothing can be drawn
  }
  std::vector<float> w(n);
  // The cuts on probabilities, as a floor on w: p >= min_p * max(p) is w >= min_p (the
  // largest w is exp(0) = 1), p >= tau is w / sum >= tau.
  const double sum = exp_sum(kept.l.data(), n, m, w.data());
  const bool cut_p = cuts.top_p < 1.0f;
  const float tau = cut_p ? top_p_tau(w, sum, cuts.top_k > 0 ? cuts.top_k : n, cuts.top_p)
                          : 0.0f;
  auto stays = [&](size_t i) {
    return w[i] >= cuts.min_p && (!cut_p || static_cast<float>(w[i] / sum) >= tau);
  };
  double total = 0.0, excluded = 0.0;
  if (!cut_p && cuts.min_p == 0.0f) {  // everything stays
    total = sum;
    for (size_t i = 0; exclude >= 0 && i < n; ++i) {
      excluded += kept.id[i] == exclude ? w[i] : 0.0;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      if (stays(i)) {
        total += w[i];
        excluded += kept.id[i] == exclude ? w[i] : 0.0;
      }
    }
  }
  if (p_excluded != nullptr && total > 0) {
    *p_excluded = static_cast<float>(excluded / total);
  }
  const double target = static_cast<double>(u) * (total - excluded);
  double run = 0.0;
  size_t last = n;
  for (size_t i = 0; i < n; ++i) {
    if (!stays(i) || w[i] == 0.0f || kept.id[i] == exclude) {
      continue;
    }
    run += w[i];
    last = i;
    if (run > target) {
      return kept.id[i];
    }
  }
  // Rounding left the target past the end; or nothing but the excluded token can be drawn
  // (its probability is 1, so a residual draw is never used).
  return last < n ? kept.id[last] : (exclude >= 0 ? static_cast<uint32_t>(exclude) : 0);
}

// The model's log-probabilities of one row (log_softmax of the raw logits, as reported to
// callers): that of `token`, and the k largest with their ids, most likely first (ties: the
// lower id first). One pass for the max, one vectorized pass for the sum of exp, and the top
// k from the same rising-threshold scan as top-k sampling.
void logprobs(const float* x, int V, uint32_t token, int k, float* chosen, uint32_t* ids,
              float* values) {
  const float m = max_of(x, V);
  const double sum = exp_sum(x, V, m, nullptr);
  const float lse = m + static_cast<float>(std::log(sum));
  *chosen = token < static_cast<uint32_t>(V) ? x[token] - lse : -INFINITY;
  if (k == 0) {
    return;
  }
  Kept kept;
  top_k(x, V, 1.0f, std::min(k, V), kept);
  std::vector<Entry> top(kept.l.size());
  for (size_t j = 0; j < top.size(); ++j) {
    top[j] = {kept.l[j], kept.id[j]};
  }
  std::sort(top.begin(), top.end(), [](const Entry& a, const Entry& b) {
    return a.l > b.l || (a.l == b.l && a.id < b.id);
  });
  top.resize(std::min<size_t>(top.size(), k));
  // fewer finite logits than k: the first -inf ones, by id
  std::vector<bool> taken(top.size() < static_cast<size_t>(k) ? V : 0);
  for (const Entry& e : top) {
    if (!taken.empty()) {
      taken[e.id] = true;
    }
  }
  for (int j = 0; static_cast<int>(top.size()) < k && j < V; ++j) {
    if (!taken[j]) {
      top.push_back({x[j], static_cast<uint32_t>(j)});
    }
  }
  for (int j = 0; j < k; ++j) {
    ids[j] = top[j].id;
    values[j] = top[j].l - lse;
  }
}

class LogProbs : public Primitive {
 public:
  LogProbs(Stream stream, int k) : Primitive(stream), k_(k) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    const array logits = row_major(inputs[0], encoder);
    const array token = row_major(inputs[1], encoder);
    for (array& out : outputs) {
      out.set_data(allocator::malloc(std::max<size_t>(out.nbytes(), 1)));
      encoder.set_output_array(out);
    }
    const int V = logits.shape(-1);
    const size_t rows = outputs[0].size();
    encoder.dispatch([x = logits.data<float>(), t = token.data<uint32_t>(),
                      c = outputs[0].data<float>(), ids = outputs[1].data<uint32_t>(),
                      vals = outputs[2].data<float>(), V, rows, k = k_]() {
      auto job = [&](int part, int parts) {
        for (size_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r) {
          logprobs(x + r * V, V, t[r], k, c + r, ids + r * k, vals + r * k);
        }
      };
      pool().run(job, static_cast<int>(std::min<size_t>(pool().size(), rows)));  // 1 row: here
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.logprobs] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlLogProbs";
  }

  bool is_equivalent(const Primitive& other) const override {
    return k_ == static_cast<const LogProbs&>(other).k_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    const Shape rows = inputs[1].shape();
    Shape top = rows;
    top.push_back(k_);
    return {rows, top, top};
  }

 private:
  int k_;
};

class Sample : public Primitive {
 public:
  // split: the rows come as arrays of their own (a batched step's rows, not stacked).
  Sample(Stream stream, Cuts cuts, bool split = false)
      : Primitive(stream), cuts_(cuts), split_(split) {}

  // inputs: logits [..., V], u [...] (, exclude [...]); split: u [n], then n rows [V].
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    const array u = row_major(inputs[split_ ? 0 : 1], encoder);
    const int32_t* ex = !split_ && inputs.size() > 2
                            ? row_major(inputs[2], encoder).data<int32_t>()
                            : nullptr;
    const int V = inputs[split_ ? 1 : 0].shape(-1);
    const size_t rows = outputs[0].size();
    std::vector<const float*> xs;
    if (split_) {
      for (size_t i = 1; i < inputs.size(); ++i) {
        xs.push_back(row_major(inputs[i], encoder).data<float>());
      }
    } else {
      const float* x = row_major(inputs[0], encoder).data<float>();
      for (size_t r = 0; r < rows; ++r) {
        xs.push_back(x + r * V);
      }
    }
    for (array& out : outputs) {
      out.set_data(allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
    }
    float* pe = outputs.size() > 1 ? outputs[1].data<float>() : nullptr;
    encoder.dispatch([xs = std::move(xs), pu = u.data<float>(), ex, pe,
                      po = outputs[0].data<uint32_t>(), V, rows, cuts = cuts_]() {
      auto job = [&](int part, int parts) {
        for (size_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r) {
          po[r] = pick(xs[r], V, pu[r], cuts, ex ? ex[r] : -1, pe ? pe + r : nullptr);
        }
      };
      pool().run(job, static_cast<int>(std::min<size_t>(pool().size(), rows)));  // 1 row: here
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[chatml.sample] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlSample";
  }

  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const Sample&>(other);
    return cuts_ == o.cuts_ && split_ == o.split_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    if (split_) {
      return {inputs[0].shape()};
    }
    const Shape& s = inputs[0].shape();
    const Shape rows(s.begin(), s.end() - 1);
    return inputs.size() > 2 ? std::vector<Shape>{rows, rows} : std::vector<Shape>{rows};
  }

 private:
  Cuts cuts_;
  bool split_;
};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.sample] " + what);
  }
}

Cuts checked(float temperature, int top_k, float top_p, float min_p) {
  check(temperature > 0 && std::isfinite(temperature), "takes a temperature > 0");
  check(top_k >= 0, "takes top_k >= 0");
  check(top_p > 0 && top_p <= 1, "takes top_p in (0, 1]");
  check(min_p >= 0 && min_p < 1, "takes min_p in [0, 1)");
  return Cuts{temperature, top_k, top_p, min_p};
}

Cuts checked(const array& logits, const array& u, float temperature, int top_k, float top_p,
             float min_p) {
  check(logits.dtype() == float32 && u.dtype() == float32, "takes float32 logits and u");
  check(logits.ndim() >= 1 && logits.shape(-1) > 0, "takes logits [..., V] with V > 0");
  const Shape rows(logits.shape().begin(), logits.shape().end() - 1);
  check(u.shape() == rows, "takes one u per row of logits");
  return checked(temperature, top_k, top_p, min_p);
}

array sample(const array& logits, const array& u, float temperature, int top_k, float top_p,
             float min_p) {
  const Cuts cuts = checked(logits, u, temperature, top_k, top_p, min_p);
  Stream s = default_stream(Device::cpu);
  return array(u.shape(), uint32, std::make_shared<Sample>(s, cuts), {logits, u});
}

array sample_rows(const std::vector<array>& rows, const array& u, float temperature, int top_k,
                  float top_p, float min_p) {
  check(!rows.empty(), "sample_rows takes at least one row");
  for (const array& row : rows) {
    check(row.dtype() == float32 && row.ndim() == 1 && row.shape(0) > 0 &&
              row.shape(0) == rows[0].shape(0),
          "sample_rows takes float32 rows [V] of one V > 0");
  }
  check(u.dtype() == float32 && u.ndim() == 1 && u.shape(0) == static_cast<int>(rows.size()),
        "takes one u per row of logits");
  const Cuts cuts = checked(temperature, top_k, top_p, min_p);
  std::vector<array> inputs{u};
  inputs.insert(inputs.end(), rows.begin(), rows.end());
  Stream s = default_stream(Device::cpu);
  return array(u.shape(), uint32, std::make_shared<Sample>(s, cuts, true), std::move(inputs));
}

std::vector<array> sample_excluding(const array& logits, const array& u, const array& exclude,
                                    float temperature, int top_k, float top_p, float min_p) {
  const Cuts cuts = checked(logits, u, temperature, top_k, top_p, min_p);
  check(exclude.dtype() == int32 && exclude.shape() == u.shape(),
        "takes one int32 id (or -1) to exclude per row");
  Stream s = default_stream(Device::cpu);
  return array::make_arrays({u.shape(), u.shape()}, {uint32, float32},
                            std::make_shared<Sample>(s, cuts), {logits, u, exclude});
}

std::vector<array> log_probs(const array& logits, const array& token, int k) {
  check(logits.dtype() == float32 && logits.ndim() >= 1 && logits.shape(-1) > 0,
        "logprobs takes float32 logits [..., V] with V > 0");
  const Shape rows(logits.shape().begin(), logits.shape().end() - 1);
  check(token.dtype() == uint32 && token.shape() == rows, "logprobs takes one uint32 token per row");
  check(k >= 0 && k <= logits.shape(-1), "logprobs takes 0 <= k <= V");
  Shape top = rows;
  top.push_back(k);
  Stream s = default_stream(Device::cpu);
  return array::make_arrays({rows, top, top}, {float32, uint32, float32},
                            std::make_shared<LogProbs>(s, k), {logits, token});
}

}  // namespace

void bind_sampling(nb::module_& m) {
  m.def("logprobs", &log_probs, nb::arg("logits"), nb::arg("token"), nb::arg("k"),
        "The log-probabilities (log_softmax) of rows of logits [..., V]: of `token` [...], "
        "and the k largest [..., k] with their ids, most likely first (CPU, float32).");
  m.def("sample", &sample, nb::arg("logits"), nb::arg("u"), nb::arg("temperature"),
        nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("min_p") = 0.0f,
        "A token per row of logits [..., V]: the temperature, top-k, min-p and top-p cuts, "
        "then the inverse CDF at u [...] in index order (CPU, float32).");
  m.def("sample_rows", &sample_rows, nb::arg("rows"), nb::arg("u"), nb::arg("temperature"),
        nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("min_p") = 0.0f,
        "sample() over rows given as arrays [V] of their own (a batched step's rows, not "
        "stacked): a token per row, at u [n].");
  m.def("sample_excluding", &sample_excluding, nb::arg("logits"), nb::arg("u"),
        nb::arg("exclude"), nb::arg("temperature"), nb::arg("top_k") = 0,
        nb::arg("top_p") = 1.0f, nb::arg("min_p") = 0.0f,
        "sample() with one id per row (int32, -1: none) left out of the draw: returns the "
        "tokens and the probability the cut distribution gives each excluded id.");
}

}  // namespace chatml
