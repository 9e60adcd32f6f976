"""Modes: named presets of pass lists, and the programs each mode runs.

The modes whose ranks hold one model (as under DDP) start every step from rank
0's buffers (broadcast_buffers, DDP's broadcast_buffers=True); those whose ranks
train replicas of their own between averages (local SGD's local and sync steps,
decentralized) keep each rank's buffers, as they keep its parameters."""

# The first pass of the modes that broadcast the buffers; transpile(broadcast_buffers=False)
# drops it.
BROADCAST_BUFFERS = "broadcast_buffers"
# The collectives of the model's own code (SyncBatchNorm's), independent ones issued as one.
MODEL_COLLECTIVES = "coalesce_model_collectives"
# Paddle's GradAllReduce: each gradient averaged by its own all-reduce.
GRAD_ALLREDUCE = (BROADCAST_BUFFERS, MODEL_COLLECTIVES, "average_grads", "insert_allreduce",
                  "ring_round_robin")
# Paddle's fuse_all_reduce: gradients in fused buckets, overlapped with backward.
_FUSED = ("average_grads", "coalesce_tensors", "ring_round_robin", "schedule_comm")
FUSE_ALL_REDUCE = (BROADCAST_BUFFERS, MODEL_COLLECTIVES) + _FUSED
# The pass of mode zero that keeps the optimizers' state as shards.
SHARD_OPTIMIZER = "shard_optimizer"
# ZeRO-2: gradients reduce-scattered in buckets, each rank updates its shard of
# the parameters and the optimizer state, the parameters all-gathered; each
# bucket's update and all-gather as soon as its reduce-scatter is done.
ZERO = (BROADCAST_BUFFERS, MODEL_COLLECTIVES, "average_grads", SHARD_OPTIMIZER, "ring_round_robin", "schedule_comm",
        "schedule_updates")
# ZeRO-3 (FSDP): mode zero whose parameters stay sharded between steps too,
# each bucket gathered just before its first use in the step.
FSDP = ZERO + ("shard_params",)
# Paddle's all_gather mode: every rank gathers every rank's gradients and applies
# the update once per rank's gradient, in rank order.
ALL_GATHER = (BROADCAST_BUFFERS, MODEL_COLLECTIVES, "gather_grads", "ring_round_robin", "schedule_comm")
# Decentralized (Decent-DP's gossip): each rank averages its parameters with its
# group of the topology at this step (a program per step of its period), then
# updates them with its own gradient; the parameter sums are issued as the step
# starts and overlap the forward and backward passes.
DECENTRALIZED = ("mix_params", MODEL_COLLECTIVES, "coalesce_tensors", "ring_round_robin", "schedule_comm")
# Paddle's LocalSGD: the local program takes its step without communication; the
# sync program also averages the parameters, its deltas reduced by the same
# passes that reduce gradients in fuse_all_reduce.
LOCAL_SGD = {
    "warmup": FUSE_ALL_REDUCE,
    "local": ("snapshot_params", MODEL_COLLECTIVES),
    "sync": ("snapshot_params", MODEL_COLLECTIVES, "local_sgd") + _FUSED[1:],
}

# DiLoCo: local steps as local SGD's; each sync program also averages one
# fragment's pseudo-gradients (snapshot - parameter) for the outer step the
# schedule takes on the host.
DILOCO = {
    "local": LOCAL_SGD["local"],
    "sync": ("snapshot_params", MODEL_COLLECTIVES, "pseudo_gradients") + _FUSED[1:],
}
# Streaming DiLoCo with fragment_sync_delay: the sync cut in two programs, the
# sums issued in one and waited on in a later one.
DILOCO["deferred"] = DILOCO["sync"] + ("defer_waits",)

MODES: dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]] = {
    "grad_allreduce": GRAD_ALLREDUCE,
    "fuse_all_reduce": FUSE_ALL_REDUCE,
    "local_sgd": LOCAL_SGD,
    "diloco": DILOCO,
    "zero": ZERO,
    "fsdp": FSDP,
    "all_gather": ALL_GATHER,
    "decentralized": DECENTRALIZED,
}

# Run once before the first step: every rank starts from rank 0's state.
STARTUP_PASSES: tuple[str, ...] = ("broadcast_params", "ring_round_robin")
