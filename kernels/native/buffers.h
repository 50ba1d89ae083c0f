// Output buffers for the CPU primitives: MLX's donation rule in one place.
#pragma once

#include "mlx/allocator.h"
#include "mlx/array.h"

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

}  // namespace chatml
