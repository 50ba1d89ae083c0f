// Output buffers for the CPU primitives: MLX's donation rule in one place.
#pragma once

#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace chatml {

// `out` (same size and dtype as `in`) takes over `in`'s buffer when nobody else holds it and
// it is one dense block, so the kernel writes in place; otherwise it gets a buffer of its own.
inline void donate_or_alloc(const mlx::core::array& in, mlx::core::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.data_size() == in.size()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  }
}

// Whether `a`'s elements lie row-major from its data pointer (dimensions of size 1 aside): a
// parameter, a row range of a bigger matrix (the joined decode projections' parts, see
// engine/runtime/fused.py), a reshaped activation. MLX's flags say no for such views, and its
// contiguous() copied a view of weights on every call.
inline bool is_row_major(const mlx::core::array& a) {
  int64_t expect = 1;
  for (int d = static_cast<int>(a.ndim()) - 1; d >= 0; --d) {
    if (a.shape(d) != 1 && a.strides()[d] != expect) {
      return false;
    }
    expect *= a.shape(d);
  }
  return true;
}

// The kernels read their inputs as row-major buffers. They take their inputs as they come
// (no contiguous() node in the graph: in a compiled decode step each was one more dispatch,
// 388 of them in a 0.8B step), and this makes an input that is not row-major so while the
// primitive runs: a temporary the encoder keeps alive, filled by a task queued before the
// kernel's. Returns the array to read.
inline mlx::core::array row_major(const mlx::core::array& a,
                                  mlx::core::cpu::CommandEncoder& encoder) {
  if (is_row_major(a)) {
    return a;
  }
  mlx::core::array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  encoder.add_temporary(out);
  encoder.dispatch([src = a, dst = out]() mutable {
    // Copied a run at a time: the trailing dimensions that already lie row-major in `src`
    // (a row of a joined projection, a head) are one memcpy; the dimensions before them are
    // walked as an odometer.
    const size_t item = src.itemsize();
    const int nd = static_cast<int>(src.ndim());
    int64_t run = 1;
    int outer = nd;  // dimensions [0, outer) are walked, [outer, nd) are the run
    while (outer > 0 && (src.shape(outer - 1) == 1 || src.strides()[outer - 1] == run)) {
      run *= src.shape(--outer);
    }
    const char* base = src.data<char>();
    char* to = dst.data<char>();
    std::vector<int64_t> at(outer, 0);
    for (size_t i = 0; i < src.size(); i += run) {
      int64_t offset = 0;
      for (int d = 0; d < outer; ++d) {
        offset += at[d] * src.strides()[d];
      }
      std::memcpy(to + i * item, base + offset * static_cast<int64_t>(item), run * item);
      for (int d = outer - 1; d >= 0 && ++at[d] == src.shape(d); --d) {
        at[d] = 0;
      }
    }
  });
  return out;
}

// An input read row-major (`row_major`) and the output written from it: `out` takes `in`'s
// buffer where nobody else holds it (the kernel then writes in place), else one of its own.
// Donation is decided on `in` itself: a copy of the handle, such as row_major returns, would
// count as one more holder and never donate.
inline mlx::core::array read_into(const mlx::core::array& in, mlx::core::array& out,
                                  mlx::core::cpu::CommandEncoder& encoder) {
  if (is_row_major(in)) {
    donate_or_alloc(in, out);
    return in;
  }
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  return row_major(in, encoder);
}

}  // namespace chatml
