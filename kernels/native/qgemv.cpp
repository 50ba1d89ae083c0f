// Quantized GEMV on the CPU as an MLX primitive: y = x @ dequantize(w).T for a few rows of x.
//
// The weights stay in MLX's affine layout, as mlx-community checkpoints store them: `w` is
// uint32 [N, K * bits / 32] with the lowest bits holding the first element, `scales` and
// `biases` are [N, K / group_size], and w_real[n, k] = scale[n, g] * q[n, k] + bias[n, g].
// Activations are not quantized (the same math as mlx-lm), so per output row:
//   y[n] = sum_g scale[n, g] * dot(q[n, g], x[g]) + bias[n, g] * sum(x[g])
// The group sums of x and, for 4 bits, x with each 32-block reordered evens-then-odds (so
// that low and high nibbles meet contiguous activations) are computed once per call; output
// rows are split over a small pool of threads. Decode is memory bound: the kernels only need
// to turn bytes into floats faster than memory delivers them.
//
// 4 bits with AVX-512 VNNI (kernel "vnni") or AVX2 (kernel "maddubs"), and 8 bits with AVX2
// (kernel "maddwd"), multiply in integers instead: turning nibbles into floats costs more than
// reading them (a 4-bit row took as long as an 8-bit row), and on AVX2 so does turning bytes
// into floats (8-bit rows at ~11 GB/s a core). Each group of x becomes 24-bit fixed point,
// m = round(x * 2^(23 - e)) with 2^e just above the group's largest |x|, held as three signed
// bytes (m = d0 + 256 d1 + 65536 d2; for 8 bits d0 and d1 + 256 d2 as int16); `vpdpbusd` (or
// `vpmaddubsw` + `vpmaddwd`, or `vpmaddwd` alone) then sums weight * digit products exactly
// in int32. The only rounding beyond float32's is that of x to the fixed point: at
// most 2^-23 of the group's largest |x| per element (float32 rounds each x to 2^-24 of
// itself), so the product error stays at float32's level (tests/test_native.py bounds it,
// outliers included). Activations keep their float32 precision; this is not the 8-bit
// activation quantization of llama.cpp's kernels.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

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

// ---------------------------------------------------------------- kernels

// One output row's dot product over `groups` groups, for one activation row.
// xs: activations (reordered per 32-block for 4 bits), xsum: group sums of x.
template <int BITS, typename S>
struct Generic {
  static float row(const uint8_t* w, const S* scales, const S* biases, const float* xs,
                   const float* xsum, int groups, int gs) {
    float total = 0.0f;
    for (int g = 0; g < groups; ++g) {
      float acc[16] = {0};
      const float* x = xs + g * gs;
      if (BITS == 8) {
        const uint8_t* q = w + g * gs;
        for (int c = 0; c < gs; c += 16) {
          for (int j = 0; j < 16; ++j) {
            acc[j] += static_cast<float>(q[c + j]) * x[c + j];
          }
        }
      } else {
        const uint8_t* q = w + g * gs / 2;
        for (int c = 0; c < gs; c += 32) {
          for (int j = 0; j < 16; ++j) {
            uint8_t b = q[c / 2 + j];
            acc[j] += static_cast<float>(b & 15) * x[c + j];
            acc[j] += static_cast<float>(b >> 4) * x[c + 16 + j];
          }
        }
      }
      float dot = 0.0f;
      for (int j = 0; j < 16; ++j) {
        dot += acc[j];
      }
      total += static_cast<float>(scales[g]) * dot + static_cast<float>(biases[g]) * xsum[g];
    }
    return total;
  }
  static void rows(const uint8_t* w, size_t, const S* scales, const S* biases, const float* xs,
                   const float* xsum, int groups, int gs, float* y) {
    y[0] = row(w, scales, biases, xs, xsum, groups, gs);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// Each pass of a multi-row kernel prefetches (into L2) the same bytes of the block of rows
// this many passes ahead, one line per row per 64 bytes read. The hardware prefetcher alone
// kept short rows (the LM head, K = 1024: four rows are one 4 KiB page, read interleaved) at
// ~10 GB/s; with this, ~22 GB/s, square matrices unchanged (BENCHMARKS.md, "Prefetching the
// next rows").
constexpr int kPrefetchPasses = 2;

static inline void prefetch_l2(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// The scales and biases of the block of R rows kPrefetchPasses passes ahead: R rows of them
// are contiguous, and a demand miss on them stalls every group's epilogue.
template <typename S, int R>
static inline void prefetch_group_params(const S* scales, const S* biases, int groups_stride) {
  if (R > 1) {
    const size_t ahead = static_cast<size_t>(kPrefetchPasses) * R * groups_stride;
    const size_t bytes = static_cast<size_t>(R) * groups_stride * sizeof(S);
    const uint8_t* sp = reinterpret_cast<const uint8_t*>(scales + ahead);
    const uint8_t* bp = reinterpret_cast<const uint8_t*>(biases + ahead);
    for (size_t at = 0; at < bytes; at += 64) {
      prefetch_l2(sp + at);
      prefetch_l2(bp + at);
    }
  }
}

// 4 bits in integers (kernels "vnni" and "maddubs"): each group of x becomes 24-bit fixed
// point, three signed bytes per element. Activations of one x row, per 128-element block (64
// bytes of a weight row): six 64-byte planes, digit p of the low (h = 0) or high (h = 1)
// nibbles' x, plane (2p + h) byte j holding digit p of x[b + 2j + h]; and per group the fixed
// point's unit 2^(e - 23), folded into the group's scale.
// Eight int32 digits in [-128, 127] as eight bytes at `at`.
static inline void store_digits(int8_t* at, __m256i d) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(at), _mm_packs_epi16(w, w));
}

// The fixed-point exponent of one group of x: e with max|x| < 2^e (*top), with room for the
// balanced digits; false if the group holds an inf or a nan (its products are not numbers).
static inline bool group_exponent(const float* xg, int gs, int* e, float* top) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 top8 = _mm256_setzero_ps(), wild = _mm256_setzero_ps();
  for (int k = 0; k < gs; k += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + k));
    top8 = _mm256_max_ps(top8, a);
    wild = _mm256_or_ps(wild, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or nan
  }
  if (_mm256_movemask_ps(wild) != 0) {
    return false;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  *top = *std::max_element(lanes, lanes + 8);
  std::frexp(*top, e);  // top < 2^e
  // Three balanced base-256 digits reach 2^23 - 2^15 - 2^7 - 1: one more bit of headroom
  // for the groups whose largest |x| is within 0.4% of 2^e.
  if (*top > 0.0f && std::ldexp(*top, 23 - *e) >= 8355711.0f) {
    ++*e;
  }
  return true;
}

// x * 2^(23 - e) rounded to the nearest integer (ties to even, as lrint), for 8 elements; the
// factor goes in two exact halves: 2^(23 - e) alone overflows a float for subnormal top.
struct FixedScale {
  __m256 s1, s2;
  explicit FixedScale(int e)
      : s1(_mm256_set1_ps(std::ldexp(1.0f, (23 - e) / 2))),
        s2(_mm256_set1_ps(std::ldexp(1.0f, (23 - e) - (23 - e) / 2))) {}
  __m256i operator()(__m256 v) const {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v, s1), s2));
  }
};

// The lowest balanced base-256 digit of m, in [-128, 127].
static inline __m256i low_digit(__m256i m) {
  const __m256i half = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
  return _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(m, half), byte), half);
}

// The even (h = 0) or odd (h = 1) elements of x[0..16) in fixed point, as three digits into
// planes 2p + h at byte j.
static inline void fixed_digits(__m256 v, const FixedScale& scale, int8_t* block, int h, int j) {
  __m256i m = scale(v);
  for (int p = 0; p < 3; ++p) {
    const __m256i d = low_digit(m);
    store_digits(block + (2 * p + h) * 64 + j, d);
    m = _mm256_srai_epi32(_mm256_sub_epi32(m, d), 8);
  }
}

// Each group g of an x row in fixed point: its unit 2^(e - 23) into unit[g], then `write(g, xg,
// scale)` stores its digits, or `clear(g)` zeroes them where the group is not finite (unit
// nan). Returns the largest exponent e (max|x| < 2^e) of the row's nonzero finite groups,
// INT_MIN if there are none.
template <typename Write, typename Clear>
static int fixed_groups(const float* x, int K, int gs, float* unit, Write write, Clear clear) {
  int row_e = std::numeric_limits<int>::min();
  for (int g = 0; g < K / gs; ++g) {
    const float* xg = x + static_cast<size_t>(g) * gs;
    int e = 0;
    float top = 0.0f;
    if (!group_exponent(xg, gs, &e, &top)) {
      unit[g] = std::numeric_limits<float>::quiet_NaN();
      clear(g);
      continue;
    }
    unit[g] = std::ldexp(1.0f, e - 23);
    if (top > 0.0f) {
      row_e = std::max(row_e, e);
    }
    write(g, xg, FixedScale(e));
  }
  return row_e;
}

// 4 bits: the planes described above.
static int fixed_point(const float* x, int K, int gs, int8_t* planes, float* unit) {
  const auto at = [&](int g, int* j0) {
    const int first = g * gs, b = first / 128 * 128;
    *j0 = (first - b) / 2;
    return planes + static_cast<size_t>(b) * 3;
  };
  const auto clear = [&](int g) {
    int j0 = 0;
    int8_t* block = at(g, &j0);
    for (int plane = 0; plane < 6; ++plane) {
      std::memset(block + plane * 64 + j0, 0, static_cast<size_t>(gs) / 2);
    }
  };
  const auto write = [&](int g, const float* xg, const FixedScale& scale) {
    int j0 = 0;
    int8_t* block = at(g, &j0);
    for (int k = 0; k < gs; k += 16) {
      const __m256 lo = _mm256_loadu_ps(xg + k), hi = _mm256_loadu_ps(xg + k + 8);
      // shuffle_ps picks within 128-bit lanes: [x0 x2 x8 x10 | x4 x6 x12 x14]; the 64-bit
      // permute puts them in order.
      const auto in_order = [](__m256 v) {
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
      };
      const int j = j0 + k / 2;
      fixed_digits(in_order(_mm256_shuffle_ps(lo, hi, 0x88)), scale, block, 0, j);
      fixed_digits(in_order(_mm256_shuffle_ps(lo, hi, 0xDD)), scale, block, 1, j);
    }
  };
  return fixed_groups(x, K, gs, unit, write, clear);
}
#endif

#if defined(__AVX512F__)
constexpr int kBlock = 32;  // 4-bit reorder block: 16 low + 16 high nibbles per 16 bytes
constexpr const char* kIsa = "avx512";
constexpr int kRows = 4;  // output rows per pass: each activation load feeds four rows

// R output rows at once (rows `stride` bytes apart); writes y[0..R).
template <int BITS, typename S, int R>
static inline void rows_avx512(const uint8_t* w, size_t stride, const S* scales,
                               const S* biases, int groups_stride, const float* xs,
                               const float* xsum, int groups, int gs, float* y) {
  __m512 total[R];
  float bias_part[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    bias_part[r] = 0.0f;
  }
  const __m512i low = _mm512_set1_epi32(15);
  prefetch_group_params<S, R>(scales, biases, groups_stride);
  for (int g = 0; g < groups; ++g) {
    const float* x = xs + g * gs;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_setzero_ps();
      acc[r][1] = _mm512_setzero_ps();
    }
    for (int c = 0; c < gs; c += 32) {
      __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
      for (int r = 0; r < R; ++r) {
        if (BITS == 8) {
          const uint8_t* q = w + r * stride + g * gs + c;
          if ((c & 63) == 0) {
            prefetch_l2(q + kPrefetchPasses * R * stride);
          }
          __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
          __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));
          acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), x0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), x1, acc[r][1]);
        } else {
          const uint8_t* q = w + r * stride + (g * gs + c) / 2;
          if ((c & 127) == 0) {
            prefetch_l2(q + kPrefetchPasses * R * stride);
          }
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
          __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
          __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
          acc[r][0] = _mm512_fmadd_ps(lo, x0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(hi, x1, acc[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * groups_stride + g;
      __m512 scale = _mm512_set1_ps(static_cast<float>(scales[at]));
      total[r] = _mm512_fmadd_ps(scale, _mm512_add_ps(acc[r][0], acc[r][1]), total[r]);
      bias_part[r] += static_cast<float>(biases[at]) * xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r] = _mm512_reduce_add_ps(total[r]) + bias_part[r];
  }
}

template <int BITS, typename S>
struct Simd {
  static float row(const uint8_t* w, const S* scales, const S* biases, const float* xs,
                   const float* xsum, int groups, int gs) {
    float y;
    rows_avx512<BITS, S, 1>(w, 0, scales, biases, groups, xs, xsum, groups, gs, &y);
    return y;
  }
  static void rows(const uint8_t* w, size_t stride, const S* scales, const S* biases,
                   const float* xs, const float* xsum, int groups, int gs, float* y) {
    rows_avx512<BITS, S, kRows>(w, stride, scales, biases, groups, xs, xsum, groups, gs, y);
  }
};
#if defined(__AVX512VNNI__)
#define CHATML_Q4_FIXED 1
constexpr const char* kFixedIsa = "vnni";  // vpdpbusd: 64 nibble * digit products a step
constexpr int kFixedRows = kRows;

// The scales of a 128-weight block per dword lane (lane l holds weights 8l..8l+7), each
// times its group's fixed-point unit.
template <typename S, int GS>
static inline __m512 block_scales(const S* scales, const float* unit, int g) {
  if (GS == 128) {
    return _mm512_set1_ps(static_cast<float>(scales[g]) * unit[g]);
  } else if (GS == 64) {
    return _mm512_insertf32x8(_mm512_set1_ps(static_cast<float>(scales[g]) * unit[g]),
                              _mm256_set1_ps(static_cast<float>(scales[g + 1]) * unit[g + 1]),
                              1);
  } else {
    const __m128 four = _mm_setr_ps(
        static_cast<float>(scales[g]) * unit[g], static_cast<float>(scales[g + 1]) * unit[g + 1],
        static_cast<float>(scales[g + 2]) * unit[g + 2],
        static_cast<float>(scales[g + 3]) * unit[g + 3]);
    const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
  }
}

// R output rows of 4-bit weights against one x row prepared by fixed_point.
template <typename S, int GS, int R>
static inline void rows_fixed(const uint8_t* w, size_t stride, const S* scales, const S* biases,
                             int groups_stride, const int8_t* planes, const float* unit,
                             const float* xsum, int K, float* y) {
  __m512 total[R];
  float bias_part[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    bias_part[r] = 0.0f;
  }
  prefetch_group_params<S, R>(scales, biases, groups_stride);
  const __m512i nibble = _mm512_set1_epi8(15);
  const __m512 radix2 = _mm512_set1_ps(65536.0f);
  constexpr int kGroups = 128 / GS;  // groups per block
  for (int b = 0; b < K; b += 128) {
    const int8_t* d = planes + static_cast<size_t>(b) * 3;
    const __m512i d0l = _mm512_loadu_si512(d), d0h = _mm512_loadu_si512(d + 64);
    const __m512i d1l = _mm512_loadu_si512(d + 128), d1h = _mm512_loadu_si512(d + 192);
    const __m512i d2l = _mm512_loadu_si512(d + 256), d2h = _mm512_loadu_si512(d + 320);
    const int g = b / GS;
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = w + r * stride + b / 2;
      prefetch_l2(q + kPrefetchPasses * R * stride);
      const __m512i v = _mm512_loadu_si512(q);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512i zero = _mm512_setzero_si512();
      const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, d0l), hi, d0h);
      const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, d1l), hi, d1h);
      const __m512i p2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, d2l), hi, d2h);
      // |p0|, |p1| <= 8 * 15 * 128: p1 * 256 + p0 is exact in int32 and in float
      const __m512i low = _mm512_add_epi32(_mm512_slli_epi32(p1, 8), p0);
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), radix2, _mm512_cvtepi32_ps(low));
      const S* sr = scales + static_cast<size_t>(r) * groups_stride;
      total[r] = _mm512_fmadd_ps(block_scales<S, GS>(sr, unit, g), sum, total[r]);
      const S* br = biases + static_cast<size_t>(r) * groups_stride;
      for (int i = 0; i < kGroups; ++i) {
        bias_part[r] += static_cast<float>(br[g + i]) * xsum[g + i];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r] = _mm512_reduce_add_ps(total[r]) + bias_part[r];
  }
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define CHATML_Q4_FIXED 1
constexpr const char* kFixedIsa = "maddubs";  // vpmaddubsw: 32 products a step, in int16
constexpr int kFixedRows = 4;
constexpr int kBlock = 16;  // 8 low + 8 high nibbles per 8 bytes
constexpr const char* kIsa = "avx2";
constexpr int kRows = 1;

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, typename S>
struct Simd {
  static float row(const uint8_t* w, const S* scales, const S* biases, const float* xs,
                   const float* xsum, int groups, int gs) {
    __m256 total0 = _mm256_setzero_ps(), total1 = _mm256_setzero_ps();
    float bias_part = 0.0f;
    const __m256i low = _mm256_set1_epi32(15);
    for (int g = 0; g < groups; ++g) {
      const float* x = xs + g * gs;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      if (BITS == 8) {
        const uint8_t* q = w + g * gs;
        for (int c = 0; c < gs; c += 16) {
          __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + c)));
          __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + c + 8)));
          a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v0), _mm256_loadu_ps(x + c), a0);
          a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1), _mm256_loadu_ps(x + c + 8), a1);
        }
      } else {
        const uint8_t* q = w + g * gs / 2;
        for (int c = 0; c < gs; c += 16) {
          __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + c / 2)));
          __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + c), a0);
          a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + c + 8), a1);
        }
      }
      __m256 scale = _mm256_set1_ps(static_cast<float>(scales[g]));
      if (g & 1) {
        total1 = _mm256_fmadd_ps(scale, _mm256_add_ps(a0, a1), total1);
      } else {
        total0 = _mm256_fmadd_ps(scale, _mm256_add_ps(a0, a1), total0);
      }
      bias_part += static_cast<float>(biases[g]) * xsum[g];
    }
    return hsum256(_mm256_add_ps(total0, total1)) + bias_part;
  }
  static void rows(const uint8_t* w, size_t, const S* scales, const S* biases, const float* xs,
                   const float* xsum, int groups, int gs, float* y) {
    y[0] = row(w, scales, biases, xs, xsum, groups, gs);
  }
};

// The scales of a 64-weight chunk per dword lane (lane l holds weights 8l..8l+7), each times
// its group's fixed-point unit; g is the chunk's first group.
template <typename S, int GS>
static inline __m256 chunk_scales(const S* scales, const float* unit, int g) {
  const float first = static_cast<float>(scales[g]) * unit[g];
  if (GS >= 64) {
    return _mm256_set1_ps(first);
  }
  const float second = static_cast<float>(scales[g + 1]) * unit[g + 1];
  return _mm256_setr_ps(first, first, first, first, second, second, second, second);
}

// R output rows of 4-bit weights against one x row prepared by fixed_point, with AVX2's
// vpmaddubsw (nibble * digit pairs summed in int16: at most 2 * 15 * 128, exact), vpmaddwd
// (pairs of those to int32) and the same fixed-point sums as the VNNI kernel.
template <typename S, int GS, int R>
static inline void rows_fixed(const uint8_t* w, size_t stride, const S* scales, const S* biases,
                              int groups_stride, const int8_t* planes, const float* unit,
                              const float* xsum, int K, float* y) {
  __m256 total[R];
  float bias_part[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm256_setzero_ps();
    bias_part[r] = 0.0f;
  }
  prefetch_group_params<S, R>(scales, biases, groups_stride);
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i pairs = _mm256_set1_epi16(1);
  const __m256 radix2 = _mm256_set1_ps(65536.0f);
  constexpr int kGroups = 128 / GS;  // groups per block
  for (int b = 0; b < K; b += 128) {
    const int8_t* d = planes + static_cast<size_t>(b) * 3;
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = w + r * stride + b / 2;
      prefetch_l2(q + kPrefetchPasses * R * stride);
      const S* sr = scales + static_cast<size_t>(r) * groups_stride;
      for (int c = 0; c < 64; c += 32) {  // two chunks of 64 weights (32 bytes)
        const __m256i v = _mm256_loadu_si256((const __m256i*)(q + c));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        __m256i p[3];
        for (int k = 0; k < 3; ++k) {  // digit k: low nibbles meet plane 2k, high plane 2k + 1
          const __m256i dl = _mm256_loadu_si256((const __m256i*)(d + 128 * k + c));
          const __m256i dh = _mm256_loadu_si256((const __m256i*)(d + 128 * k + 64 + c));
          const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, dl),
                                                _mm256_maddubs_epi16(hi, dh));
          p[k] = _mm256_madd_epi16(both, pairs);  // |p| <= 8 * 15 * 128
        }
        const __m256i low = _mm256_add_epi32(_mm256_slli_epi32(p[1], 8), p[0]);
        const __m256 sum =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[2]), radix2, _mm256_cvtepi32_ps(low));
        total[r] = _mm256_fmadd_ps(chunk_scales<S, GS>(sr, unit, (b + 2 * c) / GS), sum, total[r]);
      }
      const S* br = biases + static_cast<size_t>(r) * groups_stride;
      for (int i = 0; i < kGroups; ++i) {
        bias_part[r] += static_cast<float>(br[b / GS + i]) * xsum[b / GS + i];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r] = hsum256(total[r]) + bias_part[r];
  }
}

// 8 bits in integers (kernel "maddwd"): x in the same 24-bit fixed point, m = lo + 256 hi with
// lo its lowest balanced digit, both as int16 (|hi| <= 32639); each 16-element block of x is
// 16 lo then 16 hi. The float kernel turns two bytes into floats per multiply-add and is bound
// by those instructions on AVX2 (~11 GB/s a core, under what memory gives).
#define CHATML_Q8_FIXED 1
constexpr const char* kFixed8Isa = "maddwd";  // vpmaddwd: 16 weight * digit products a step
constexpr int kFixed8Rows = 1;

static int fixed_point16(const float* x, int K, int gs, int16_t* planes, float* unit) {
  const auto clear = [&](int g) {
    std::memset(planes + static_cast<size_t>(g) * gs * 2, 0, sizeof(int16_t) * 2 * gs);
  };
  const auto write = [&](int g, const float* xg, const FixedScale& scale) {
    int16_t* out = planes + static_cast<size_t>(g) * gs * 2;
    for (int k = 0; k < gs; k += 16) {
      const __m256i m0 = scale(_mm256_loadu_ps(xg + k)), m1 = scale(_mm256_loadu_ps(xg + k + 8));
      const __m256i d0 = low_digit(m0), d1 = low_digit(m1);
      const __m256i h0 = _mm256_srai_epi32(_mm256_sub_epi32(m0, d0), 8);
      const __m256i h1 = _mm256_srai_epi32(_mm256_sub_epi32(m1, d1), 8);
      // packs works within 128-bit lanes ([a0-3 b0-3 | a4-7 b4-7]); the permute orders them.
      const auto packed = [](__m256i a, __m256i b) {
        return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      };
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * k), packed(d0, d1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * k + 16), packed(h0, h1));
    }
  };
  return fixed_groups(x, K, gs, unit, write, clear);
}

// R output rows of 8-bit weights against one x row prepared by fixed_point16: each weight
// zero-extended to int16 meets lo and hi in vpmaddwd (pairs of products summed exactly in
// int32: at most 2 * 255 * 32639 a pair, GS / 8 of them a lane, < 2^31 for GS <= 128).
template <typename S, int GS, int R>
static inline void rows_fixed8(const uint8_t* w, size_t stride, const S* scales,
                               const S* biases, int groups_stride, const int16_t* planes,
                               const float* unit, const float* xsum, int K, float* y) {
  __m256 total[R];
  float bias_part[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm256_setzero_ps();
    bias_part[r] = 0.0f;
  }
  prefetch_group_params<S, R>(scales, biases, groups_stride);
  const __m256 radix = _mm256_set1_ps(256.0f);
  for (int g = 0; g < K / GS; ++g) {
    const int16_t* d = planes + static_cast<size_t>(g) * GS * 2;
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_setzero_si256();
      hi[r] = _mm256_setzero_si256();
    }
    for (int c = 0; c < GS; c += 16) {
      const __m256i xl = _mm256_loadu_si256((const __m256i*)(d + 2 * c));
      const __m256i xh = _mm256_loadu_si256((const __m256i*)(d + 2 * c + 16));
      for (int r = 0; r < R; ++r) {
        const uint8_t* q = w + r * stride + g * GS + c;
        if ((g * GS + c) % 64 == 0) {
          prefetch_l2(q + kPrefetchPasses * R * stride);
        }
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)q));
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(v, xl));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(v, xh));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sum =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), radix, _mm256_cvtepi32_ps(lo[r]));
      const size_t at = static_cast<size_t>(r) * groups_stride + g;
      const float scale = static_cast<float>(scales[at]) * unit[g];
      total[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), sum, total[r]);
      bias_part[r] += static_cast<float>(biases[at]) * xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r] = hsum256(total[r]) + bias_part[r];
  }
}
#else
constexpr int kBlock = 32;
constexpr const char* kIsa = "generic";
constexpr int kRows = 1;
template <int BITS, typename S>
using Simd = Generic<BITS, S>;
#endif

// Which kernel family runs: CHATML_GEMV_ISA=generic forces the portable one, =float the
// float-activation SIMD kernels where the fixed-point 4-bit kernels would run (both for tests
// and benchmarks).
static std::string forced_isa() {
  const char* env = std::getenv("CHATML_GEMV_ISA");
  return env != nullptr ? std::string(env) : std::string();
}

static bool use_generic() {
  return forced_isa() == "generic";
}

// The kernel a product of `bits`-bit weights with row length K, group size gs takes: the
// fixed-point one where this CPU has it (4 bits: rows in whole 128-weight blocks), else kIsa.
static const char* kernel_for(int bits, int K, int gs) {
  const std::string forced = forced_isa();
  if (forced == "generic") {
    return "generic";
  }
  [[maybe_unused]] const bool groups = gs == 32 || gs == 64 || gs == 128;
#if defined(CHATML_Q4_FIXED)
  if (bits == 4 && forced != "float" && groups && K % 128 == 0) {
    return kFixedIsa;
  }
#endif
#if defined(CHATML_Q8_FIXED)
  if (bits == 8 && forced != "float" && groups) {
    return kFixed8Isa;
  }
#endif
  return kIsa;
}

// Group sums of x, in double: [M, groups].
static std::vector<float> group_sums(const float* x, int M, int K, int gs) {
  const int groups = K / gs;
  std::vector<float> xsum(static_cast<size_t>(M) * groups);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + static_cast<size_t>(m) * K + static_cast<size_t>(g) * gs;
      double s = 0.0;
      for (int k = 0; k < gs; ++k) {
        s += xg[k];
      }
      xsum[static_cast<size_t>(m) * groups + g] = static_cast<float>(s);
    }
  }
  return xsum;
}

// Splits the N output rows over the pool in contiguous ranges, multiples of 16 so that threads
// do not share cache lines of y: `block(n)` computes rows [n, n + BLOCK) for every x row,
// `one(n)` row n (a range's remainder, or every row when BLOCK is 1).
template <int BLOCK, typename F1, typename FB>
static void split_rows(int N, size_t row_bytes, F1 one, FB block) {
  auto job = [&](int part, int parts) {
    int chunk = ((N + parts - 1) / parts + 15) / 16 * 16;
    int n0 = std::min(N, part * chunk), n1 = std::min(N, n0 + chunk);
    int n = n0;
    if (BLOCK > 1) {  // the common decode case: blocks of rows share x loads
      for (; n + BLOCK <= n1; n += BLOCK) {
        block(n);
      }
    }
    for (; n < n1; ++n) {
      one(n);
    }
  };
  pool().run(job, parts_for(row_bytes * N));
}

#if defined(CHATML_Q4_FIXED)
// A fixed-point kernel's product: x prepared per row (fixed_point for 4 bits, fixed_point16 for
// 8), then blocks of output rows over the pool.
template <int BITS, typename S, int GS>
void gemv_fixed(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y,
                int M, int N, int K) {
  const int groups = K / GS;
  const size_t plane_bytes = static_cast<size_t>(K) * (BITS == 4 ? 3 : 4);  // per x row
  std::vector<int8_t> planes(static_cast<size_t>(M) * plane_bytes);
  std::vector<float> unit(static_cast<size_t>(M) * groups);
  // A row whose largest |x| is below 2^-64 would have units 2^(e - 23) near or below float's
  // smallest normal, and its products would lose their low bits or vanish: it runs scaled up
  // by 2^k and its outputs are scaled back, both exact but for the final rounding.
  std::vector<float> scaled;
  std::vector<float> back(static_cast<size_t>(M), 1.0f);
  for (int m = 0; m < M; ++m) {
    const auto prepare = [&](const float* row) {
      int8_t* at = planes.data() + static_cast<size_t>(m) * plane_bytes;
      float* u = unit.data() + static_cast<size_t>(m) * groups;
#if defined(CHATML_Q8_FIXED)
      if constexpr (BITS == 8) {
        return fixed_point16(row, K, GS, reinterpret_cast<int16_t*>(at), u);
      }
#endif
      return fixed_point(row, K, GS, at, u);
    };
    const int row_e = prepare(x + static_cast<size_t>(m) * K);
    if (row_e != std::numeric_limits<int>::min() && row_e < -64) {
      if (scaled.empty()) {
        scaled.assign(x, x + static_cast<size_t>(M) * K);
      }
      const int k = std::min(126, -row_e);
      float* row = scaled.data() + static_cast<size_t>(m) * K;
      for (int i = 0; i < K; ++i) {
        row[i] = std::ldexp(row[i], k);
      }
      prepare(row);
      back[m] = std::ldexp(1.0f, -k);
    }
  }
  if (!scaled.empty()) {
    x = scaled.data();
  }
  const std::vector<float> xsum = group_sums(x, M, K, GS);
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  auto rows = [&](auto count, int n) {
    constexpr int R = decltype(count)::value;
    float out[R];
    for (int m = 0; m < M; ++m) {
      const uint8_t* wn = w + n * row_bytes;
      const S* sn = scales + static_cast<size_t>(n) * groups;
      const S* bn = biases + static_cast<size_t>(n) * groups;
      const int8_t* xp = planes.data() + static_cast<size_t>(m) * plane_bytes;
      const float* um = unit.data() + static_cast<size_t>(m) * groups;
      const float* sm = xsum.data() + static_cast<size_t>(m) * groups;
#if defined(CHATML_Q8_FIXED)
      if constexpr (BITS == 8) {
        const auto* x16 = reinterpret_cast<const int16_t*>(xp);
        rows_fixed8<S, GS, R>(wn, row_bytes, sn, bn, groups, x16, um, sm, K, out);
      } else
#endif
      {
        rows_fixed<S, GS, R>(wn, row_bytes, sn, bn, groups, xp, um, sm, K, out);
      }
      for (int r = 0; r < R; ++r) {
        y[static_cast<size_t>(m) * N + n + r] = out[r] * back[m];
      }
    }
  };
#if defined(CHATML_Q8_FIXED)
  constexpr int kBlockRows = BITS == 8 ? kFixed8Rows : kFixedRows;
#else
  constexpr int kBlockRows = kFixedRows;
#endif
  split_rows<kBlockRows>(
      N, row_bytes, [&](int n) { rows(std::integral_constant<int, 1>{}, n); },
      [&](int n) { rows(std::integral_constant<int, kBlockRows>{}, n); });
}
#endif

template <int BITS, typename S>
void gemv(const float* x, const uint8_t* w, const S* scales, const S* biases, float* y, int M,
          int N, int K, int gs) {
#if defined(CHATML_Q4_FIXED)
  const char* kernel = kernel_for(BITS, K, gs);
  if (kernel != kIsa && std::strcmp(kernel, "generic") != 0) {
    if (gs == 32) {
      return gemv_fixed<BITS, S, 32>(x, w, scales, biases, y, M, N, K);
    } else if (gs == 64) {
      return gemv_fixed<BITS, S, 64>(x, w, scales, biases, y, M, N, K);
    }
    return gemv_fixed<BITS, S, 128>(x, w, scales, biases, y, M, N, K);
  }
#endif
  const int groups = K / gs;
  const bool generic = use_generic();
  const int block = generic ? 32 : kBlock;
  // Prepared activations: [M, K] reordered for 4 bits, and [M, groups] group sums.
  std::vector<float> xs(static_cast<size_t>(M) * K);
  const std::vector<float> xsum = group_sums(x, M, K, gs);
  for (int m = 0; m < M; ++m) {
    const float* xm = x + static_cast<size_t>(m) * K;
    float* out = xs.data() + static_cast<size_t>(m) * K;
    if (BITS == 8) {
      std::copy(xm, xm + K, out);
    } else {
      for (int b = 0; b < K; b += block) {
        for (int j = 0; j < block / 2; ++j) {
          out[b + j] = xm[b + 2 * j];
          out[b + block / 2 + j] = xm[b + 2 * j + 1];
        }
      }
    }
  }
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  auto one = [&](int n) {
    const uint8_t* wn = w + n * row_bytes;
    const S* sn = scales + static_cast<size_t>(n) * groups;
    const S* bn = biases + static_cast<size_t>(n) * groups;
    for (int m = 0; m < M; ++m) {
      const float* xm = xs.data() + static_cast<size_t>(m) * K;
      const float* sm = xsum.data() + static_cast<size_t>(m) * groups;
      y[static_cast<size_t>(m) * N + n] =
          generic ? Generic<BITS, S>::row(wn, sn, bn, xm, sm, groups, gs)
                  : Simd<BITS, S>::row(wn, sn, bn, xm, sm, groups, gs);
    }
  };
  auto block_of_rows = [&](int n) {
    if (generic) {  // the portable kernel has no row blocks
      for (int r = 0; r < kRows; ++r) {
        one(n + r);
      }
      return;
    }
    float out[kRows];
    const uint8_t* wn = w + n * row_bytes;
    const S* sn = scales + static_cast<size_t>(n) * groups;
    const S* bn = biases + static_cast<size_t>(n) * groups;
    for (int m = 0; m < M; ++m) {
      Simd<BITS, S>::rows(wn, row_bytes, sn, bn, xs.data() + static_cast<size_t>(m) * K,
                          xsum.data() + static_cast<size_t>(m) * groups, groups, gs, out);
      for (int r = 0; r < kRows; ++r) {
        y[static_cast<size_t>(m) * N + n + r] = out[r];
      }
    }
  };
  split_rows<kRows>(N, row_bytes, one, block_of_rows);
}

template <typename S>
void dispatch_bits(int bits, const float* x, const uint8_t* w, const S* s, const S* b, float* y,
                   int M, int N, int K, int gs) {
  if (bits == 8) {
    gemv<8, S>(x, w, s, b, y, M, N, K, gs);
  } else {
    gemv<4, S>(x, w, s, b, y, M, N, K, gs);
  }
}

// Float32 weights for prefill's sgemm: out[n, k] = scale * q + bias, rows over the pool.
template <int BITS, typename S>
void dequantize_rows(const uint8_t* w, const S* scales, const S* biases, float* out, int N,
                     int K, int gs) {
  const int groups = K / gs;
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  auto job = [&](int part, int parts) {
    int chunk = (N + parts - 1) / parts;
    int n0 = std::min(N, part * chunk), n1 = std::min(N, n0 + chunk);
    for (int n = n0; n < n1; ++n) {
      const uint8_t* q = w + n * row_bytes;
      float* o = out + static_cast<size_t>(n) * K;
      for (int g = 0; g < groups; ++g) {
        const float sc = static_cast<float>(scales[static_cast<size_t>(n) * groups + g]);
        const float bi = static_cast<float>(biases[static_cast<size_t>(n) * groups + g]);
        if (BITS == 8) {
          for (int j = 0; j < gs; ++j) {
            o[g * gs + j] = sc * static_cast<float>(q[g * gs + j]) + bi;
          }
        } else {
          for (int j = 0; j < gs / 2; ++j) {
            uint8_t b = q[g * gs / 2 + j];
            o[g * gs + 2 * j] = sc * static_cast<float>(b & 15) + bi;
            o[g * gs + 2 * j + 1] = sc * static_cast<float>(b >> 4) + bi;
          }
        }
      }
    }
  };
  pool().run(job, pool().size());
}

// ---------------------------------------------------------------- the primitive

class QuantizedGemv : public UnaryPrimitive {
 public:
  QuantizedGemv(Stream stream, int group_size, int bits)
      : UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    const array x = row_major(inputs[0], encoder);
    const array w = row_major(inputs[1], encoder);
    const array scales = row_major(inputs[2], encoder);
    const array biases = row_major(inputs[3], encoder);
    const int M = x.shape(0), K = x.shape(1), N = out.shape(1);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<uint8_t>(), sp = scales.data<void>(),
                      bp = biases.data<void>(), yp = out.data<float>(), dtype = scales.dtype(),
                      bits = bits_, gs = group_size_, M, N, K]() {
      if (dtype == float32) {
        dispatch_bits(bits, xp, wp, (const float*)sp, (const float*)bp, yp, M, N, K, gs);
      } else if (dtype == float16) {
        dispatch_bits(bits, xp, wp, (const float16_t*)sp, (const float16_t*)bp, yp, M, N, K, gs);
      } else {
        dispatch_bits(bits, xp, wp, (const bfloat16_t*)sp, (const bfloat16_t*)bp, yp, M, N, K,
                      gs);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[chatml.quantized_gemv] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlQuantizedGemv";
  }

  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const QuantizedGemv&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0)}};
  }

 private:
  int group_size_;
  int bits_;
};

class QuantizedDequantize : public UnaryPrimitive {
 public:
  QuantizedDequantize(Stream stream, int group_size, int bits)
      : UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    const array w = row_major(inputs[0], encoder);
    const array scales = row_major(inputs[1], encoder);
    const array biases = row_major(inputs[2], encoder);
    const int N = out.shape(0), K = out.shape(1);
    encoder.dispatch([wp = w.data<uint8_t>(), sp = scales.data<void>(), bp = biases.data<void>(),
                      op = out.data<float>(), dtype = scales.dtype(), bits = bits_,
                      gs = group_size_, N, K]() {
      auto run = [&](auto* s, auto* b) {
        using S = std::remove_cv_t<std::remove_pointer_t<decltype(s)>>;
        if (bits == 8) {
          dequantize_rows<8, S>(wp, s, b, op, N, K, gs);
        } else {
          dequantize_rows<4, S>(wp, s, b, op, N, K, gs);
        }
      };
      if (dtype == float32) {
        run((const float*)sp, (const float*)bp);
      } else if (dtype == float16) {
        run((const float16_t*)sp, (const float16_t*)bp);
      } else {
        run((const bfloat16_t*)sp, (const bfloat16_t*)bp);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[chatml.dequantize] runs on the CPU only");
  }

  const char* name() const override {
    return "ChatmlQuantizedDequantize";
  }

  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const QuantizedDequantize&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
  }

 private:
  int group_size_;
  int bits_;
};

static void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[chatml.quantized_gemv] " + what);
  }
}

// Checks w, scales and biases; returns the row length K.
static int check_weights(const array& w, const array& scales, const array& biases,
                         int group_size, int bits) {
  check(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  check(group_size == 32 || group_size == 64 || group_size == 128,
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  check(w.dtype() == uint32 && w.ndim() == 2, "w must be a 2-D uint32 array");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  check(K > 0, "w must not have empty rows");  // x.size() / K counts the rows of x
  check(K % group_size == 0, "the row length must be a multiple of group_size");
  Shape groups{N, K / group_size};
  check(scales.shape() == groups && biases.shape() == groups,
        "scales and biases must be [N, K / group_size]");
  check(scales.dtype() == biases.dtype() &&
            (scales.dtype() == float32 || scales.dtype() == float16 ||
             scales.dtype() == bfloat16),
        "scales and biases must share a float dtype (float32, float16, bfloat16)");
  return K;
}

// x [..., K] float32 times dequantize(w, scales, biases).T -> [..., N] float32.
array quantized_gemv(const array& x, const array& w, const array& scales, const array& biases,
                     int group_size, int bits) {
  const int K = check_weights(w, scales, biases, group_size, bits);
  const int N = w.shape(0);
  check(x.dtype() == float32 && x.ndim() >= 1, "x must be a float32 array");
  std::ostringstream shapes;
  shapes << "x has " << x.shape(-1) << " columns, w holds " << K << " per row";
  check(x.shape(-1) == K, shapes.str());
  Stream s = default_stream(Device::cpu);
  int M = static_cast<int>(x.size() / K);
  array y(Shape{M, N}, float32, std::make_shared<QuantizedGemv>(s, group_size, bits),
          {reshape(x, {M, K}, s), w, scales, biases});
  Shape out_shape = x.shape();
  out_shape.back() = N;
  return reshape(y, out_shape, s);
}

// The float32 matrix [N, K] (scale * q + bias, as mx.dequantize computes it in float32).
array dequantize(const array& w, const array& scales, const array& biases, int group_size,
                 int bits) {
  const int K = check_weights(w, scales, biases, group_size, bits);
  Stream s = default_stream(Device::cpu);
  return array(Shape{w.shape(0), K}, float32,
               std::make_shared<QuantizedDequantize>(s, group_size, bits),
               {w, scales, biases});
}

void bind_dense(nb::module_& m);  // dense.cpp: the float32 few-row GEMV
void bind_delta(nb::module_& m);  // delta.cpp: the gated delta rule, one pass per state row
void bind_activations(nb::module_& m);  // activations.cpp: vectorized silu/sigmoid, conv + silu
void bind_sampling(nb::module_& m);  // sampling.cpp: a sampled token's cuts and draw
void bind_attention(nb::module_& m);  // attention.cpp: a few queries a row over its KV cache

}  // namespace chatml

NB_MODULE(_chatml_qgemv, m) {
  m.doc() = "CPU GEMV primitives for MLX: quantized (affine, 4 and 8 bits) and float32 few-row";
  m.def("quantized_gemv", &chatml::quantized_gemv, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x @ dequantize(w, scales, biases).T for float32 x on the CPU.");
  m.def("dequantize", &chatml::dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "The float32 matrix scale * q + bias (for prefill's float32 matmul).");
  m.def("isa", [] { return std::string(chatml::kIsa); }, "The instruction set compiled for.");
  m.def(
      "kernel",
      [](int bits, int K, int gs) { return std::string(chatml::kernel_for(bits, K, gs)); },
      nb::arg("bits"), nb::arg("K") = 1024, nb::arg("group_size") = 64,
      "The kernel a product of bits-bit weights with row length K takes: vnni or maddubs "
      "(4 bits), maddwd (8 bits), else avx512, avx2 or generic.");
  m.def("threads", [] { return chatml::pool().size(); }, "Threads that split output rows.");
  m.def("mlx_version", [] { return std::string(MLX_VERSION_STR); },
        "The MLX version this module was compiled against.");
  chatml::bind_dense(m);
  chatml::bind_delta(m);
  chatml::bind_activations(m);
  chatml::bind_sampling(m);
  chatml::bind_attention(m);
}
