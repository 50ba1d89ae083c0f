"""Runtime: the MLX model, its per-layer caches, snapshots, the cached sequence, prefill and
decode, and sampling. Everything that computes on the model lives here (later also the
scheduler, speculative decoding and sharding). Imports only `checkpoints` and `kernels`,
never `storage` or `serving`, which sit on top of it.

Plug-in points for decoding features (see README, "How a step runs"):
- `step.forward(model, rows)`: the one forward pass; batching stacks rows in it, sharding
  wraps it. A `step.Row` schedules tokens (prefill chunk, decode, verify) and the positions
  whose states to keep; `step.rollback` returns to any of them; `step.accepted` is the rule
  for how many proposed tokens stand. `step.run(model, rows)` is the pass and then the picks
  of the rows that carry a sampler, made together (`sampling.pick_rows`).
- `sampling.LogitsProcessor`: one link of a row's chain (penalties, then a grammar mask,
  then the pick in `sampling.Sampler`); `reads_history` suspends running ahead, `accept`
  advances a stateful processor by the tokens that stood.
"""
