// Whole-vector float math shared by the native passes (activations.cpp, attention.cpp,
// delta.cpp, sampling.cpp): the vector type of this CPU, unaligned loads and stores, lane sums,
// dot products, exp, and one row's softmax.
//
// MLX's CPU backend computes exp one float at a time on x86 (its simd layer has no x86
// vectors, and each exp calls libm's fmaf), about 80 M/s. Here exp is a Cody-Waite reduction
// with a degree-6 polynomial on whole SIMD vectors (AVX-512, AVX2 or NEON through the
// compiler's generic vectors), a few G/s. Accuracy: within ~1 ulp of the true value from -87.3
// (below it 0, as expf's normal results end there) to 88.37 (above it inf: see `exp`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace chatml {
namespace simd {

#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;  // AVX2, NEON (two registers) and the compiler's generic vectors
#endif
typedef float vf __attribute__((vector_size(L * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(L * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

inline vf splat(float x) {
  return vf{} + x;
}

// The sum of v's lanes (on AVX-512 a tree of shuffles and adds).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float s = 0.0f;
  for (int l = 0; l < L; ++l) {
    s += v[l];
  }
  return s;
#endif
}

// a[0, n) . b[0, n): a running sum per lane, then the lanes, then the tail.
inline float dot(const float* a, const float* b, int n) {
  vf acc = {};
  int j = 0;
  for (; j + L <= n; j += L) {
    acc += load(a + j) * load(b + j);
  }
  float s = hsum(acc);
  for (; j < n; ++j) {
    s += a[j] * b[j];
  }
  return s;
}

// exp(x): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), exp(r) by
// Cephes' expf polynomial, 2^n put into the exponent bits. Inputs below -87.3 give 0 (the
// smallest normal's exponent); from 88.38, where n reaches 128, +inf, though exp is finite up
// to 88.72 (every caller passes x <= 0: softmax, sampling, the decays); NaN stays NaN.
inline vf exp(vf x) {
  const vf hi = splat(88.7228394f), lo = splat(-87.3365448f);
  const vi under = x < lo;
  const vi over = x > hi;
  const vi nan = x != x;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // round(x / ln2) by the 1.5 * 2^23 trick: exact for |n| < 2^22
  const vf magic = splat(12582912.0f);
  const vf t = x * splat(1.44269504088896341f) + magic;
  const vf n = t - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  vi bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // n + 127 in the exponent field
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vf y = p * scale;
  vi out;
  std::memcpy(&out, &y, sizeof(out));
  const vf inf = splat(INFINITY);
  vi inf_bits;
  std::memcpy(&inf_bits, &inf, sizeof(inf_bits));
  out = (out & ~under & ~over) | (inf_bits & over);
  std::memcpy(&y, &out, sizeof(y));
  return nan ? x : y;
}

inline vf sigmoid(vf x) {
  return splat(1.0f) / (splat(1.0f) + exp(-x));
}

inline float exp1(float x) {  // the same math on one float: the tails of the arrays
  vf v = splat(x);
  return exp(v)[0];
}

// max(a[0, n)), -inf for n = 0.
inline float max_of(const float* a, size_t n) {
  vf mv = splat(-INFINITY);
  size_t i = 0;
  for (; i + L <= n; i += L) {
    const vf v = load(a + i);
    mv = v > mv ? v : mv;
  }
  float m = -INFINITY;
  for (int j = 0; j < L; ++j) {
    m = std::max(m, mv[j]);
  }
  for (; i < n; ++i) {
    m = std::max(m, a[i]);
  }
  return m;
}

// The softmax of x[0, seen) into y[0, seen) in float32 (y may be x): the max, exp(x - max),
// the sum, then times 1 / sum; y[seen, width) becomes 0 (the keys a causal query does not see).
inline void softmax_row(const float* x, float* y, int seen, int width) {
  const float m = max_of(x, seen);
  vf sv = {};
  int j = 0;
  for (; j + L <= seen; j += L) {
    const vf e = exp(load(x + j) - m);
    store(y + j, e);
    sv += e;
  }
  float sum = 0.0f;
  for (int l = 0; l < L; ++l) {
    sum += sv[l];
  }
  for (; j < seen; ++j) {
    y[j] = exp1(x[j] - m);
    sum += y[j];
  }
  const float inv = 1.0f / sum;
  for (j = 0; j < seen; ++j) {
    y[j] *= inv;
  }
  std::fill(y + seen, y + width, 0.0f);
}

}  // namespace simd
}  // namespace chatml
