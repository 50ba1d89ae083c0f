"""Runtime: the MLX model, its per-layer caches, snapshots, the cached sequence, prefill and
decode, and sampling. Everything that computes on the model lives here (later also the
scheduler, speculative decoding and sharding). Imports only `checkpoints` and `kernels`,
never `storage` or `serving`, which sit on top of it."""
