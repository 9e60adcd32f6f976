"""Modes: named presets of pass lists."""

MODES: dict[str, tuple[str, ...]] = {
    # Paddle's GradAllReduce: mean gradients by scaling the seed and summing.
    "grad_allreduce": ("scale_loss_grad", "insert_allreduce", "ring_round_robin"),
    # Paddle's fuse_all_reduce: gradients in fused buckets, overlapped with backward.
    "fuse_all_reduce": ("scale_loss_grad", "coalesce_tensors", "ring_round_robin",
                        "schedule_comm"),
}

# Run once before the first step: every rank starts from rank 0's state.
STARTUP_PASSES: tuple[str, ...] = ("broadcast_params", "ring_round_robin")
