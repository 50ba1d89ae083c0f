// Output buffers for the CPU primitives: MLX's donation rule in one place.
#pragma once

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/ops.h"

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

// A 2-D weight for the kernels, which read it row by row: used in place when it already is
// (rows K apart, elements adjacent), including a row range of a bigger matrix, as the joined
// decode projections leave their parts (engine/runtime/fused.py), where MLX's contiguous()
// copied the view on every call; anything else (unevaluated, transposed) goes through it.
inline mlx::core::array rows_in_place(const mlx::core::array& w, mlx::core::Stream s) {
  if (w.ndim() == 2 && w.is_available() && w.strides()[1] == 1 &&
      w.strides()[0] == static_cast<int64_t>(w.shape(1))) {
    return w;
  }
  return mlx::core::contiguous(w, false, s);
}

}  // namespace chatml
