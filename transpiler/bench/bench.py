"""Benchmark: the transpiler's data-parallel step against torch DDP and the limits.

    python -m transpiler.bench [--world-size 2] [--nodes 1] [--models wide,deep,transformer]
                               [--steps 20] [--warmup 5] [--configs a,b,...]
                               [--json PATH] [--plot PATH] [--report PATH]
    python -m transpiler.bench --varying-shapes [--configs ...] (transpiler/bench/shapes.py)

The bench launches its own ranks (spawned processes, CPU, gloo over a FileStore
in a temporary directory, torch.set_num_threads(1) in each rank so that the
ranks do not fight over the cores) and, for every model, runs every
configuration of CONFIGS on the same user step (zero_grad, forward,
cross-entropy, backward, optimizer.step), the same seeded initial weights, the
same batches (each rank its shard of a seeded global batch) and the same
optimizer (SGD, lr 0.01, momentum 0.9; --optimizer adam: Adam, lr 0.01).
Two models run their script's own step instead: resnet18 the step of
torchvision's classification reference (train_step_amp: bf16 autocast,
GradScaler, clipping, label smoothing), nanogpt the model, optimizer and step of
examples/nanogpt.py (a GPT, AdamW with weight-decay groups, 4 micro-batches of
8 sequences each, clipping, a GradScaler disabled as nanoGPT's is without
float16; run from a checkout, which has examples/):

    local                   the eager step, no communication at all
    allreduce_only          one all_reduce of a flat fp32 buffer as large as all
                            the gradients, no compute
    ddp                     torch DistributedDataParallel, eager, default settings
    ddp_compiled            torch.compile (inductor) of the DDP-wrapped model
    ddp_zero_redundancy     DDP with torch's ZeroRedundancyOptimizer (the same
                            optimizer class and settings, sharded by parameter)
    fsdp2                   torch's FSDP2: fully_shard of each block (each layer of
                            a ModuleList, each other child holding parameters that
                            it shares with no other block), then of the root
    grad_allreduce          transpile(step, mode="grad_allreduce") (nrings=2)
    grad_allreduce_nrings1  the same with nrings=1
    ...                     one line of CONFIGS per transpiler mode; a mode is
                            listed only when transpiler.MODES has it
    local_sgd               mode="local_sgd", k_steps=8: each timed sample is a
                            whole period (7 local steps and a sync), and its
                            step_ms the period's time divided by 8
    diloco                  mode="diloco", sync_every=8, outer optimizer SGD (lr 0.7,
                            Nesterov momentum 0.9): timed by period as
                            local_sgd; diloco+bf16 sums the pseudo-gradients
                            in bf16
    streaming_diloco        diloco with fragments=2, fragment_sync_delay=3: a
                            fragment's sums issued 3 steps before its outer
                            step; "Step time by program" compares each
                            program's step with a local one
    fuse_all_reduce+hierarchical  fuse_all_reduce with hierarchical=True: with
                            --nodes N (ranks told LOCAL_WORLD_SIZE = world / N,
                            simulated nodes on this machine) each bucket is
                            reduce-scattered inside the node, all-reduced
                            across nodes and all-gathered inside the node
    zero                    mode="zero": gradients reduce-scattered, state and
                            update sharded, parameters all-gathered
    fsdp                    mode="fsdp": parameters sharded between steps too,
                            each bucket gathered for each pass that reads it
    fsdp+keep_gathered      the same with reshard_after_forward=False: each
                            bucket gathered once per step
    fsdp+hierarchical       fsdp with hierarchical=True: with --nodes N, sharded
                            over each node's ranks and replicated across nodes
    <mode>+schedule_updates the mode's passes, then schedule_updates (each
                            bucket's update as soon as its collective is done)
    all_gather              mode="all_gather": gradients all-gathered, the update
                            applied once per rank's gradient
    decentralized           mode="decentralized", topology="ring": parameters
                            averaged with one neighbour per step (even world size)

What is measured, and how:

- Every configuration runs in fresh rank processes of its own, so that no
  state (compiled code, communicators, allocator, memory peak) carries from one
  configuration to the next. The inductor cache is a fresh temporary directory
  for each bench run, so compiles are cold.
- setup_s: building the step plus its first call, between barriers, on the
  slowest rank: for ddp the DDP construction (with its broadcast), for
  ddp_compiled the first compiled step (compile), for the transpiler the first
  call (trace, passes, startup broadcast, compile) plus any building during
  the warm-up. For the transpiler it is also split by phase (trace, passes,
  agreement, compile, other: the step's setup_split), printed as a second
  table. Then `--steps` timed steps.
- step_ms: each step is bracketed by dist.barrier() before and after, and each
  rank times only the step, between the barriers. step_ms is the median over
  the timed steps of the slowest rank's time for that step.
- vs_ddp = step_ms / step_ms(ddp); vs_limit = step_ms / max(step_ms(local),
  step_ms(allreduce_only)): what the step would cost with free communication,
  or with free compute. The reference configurations are always run.
- param_mb: bytes of the storage of the model's parameters this rank holds
  after the timed steps (between steps), each storage counted once (tied
  parameters, views of one buffer), for a DTensor its local shard's storage
  (FSDP2's shard, padded to ceil(rows / N) rows), max over the ranks.
- opt_state_mb: bytes of the optimizer state tensors this rank holds after the
  timed steps, max over the ranks (`--optimizer adam`: two per parameter; a
  sharded mode, FSDP2 (a DTensor's local shard) or torch's
  ZeroRedundancyOptimizer holds 1/N of them).
- sent_mb: MiB one rank sends per step, counted for the bandwidth-optimal ring
  algorithms (transpiler.collectives.sent_bytes: an all-reduce sends 2 (g-1)/g
  of its buffer among g ranks): for the transpiler, the collectives of the
  programs it ran in the timed steps; for ddp, ddp_compiled and allreduce_only,
  the all-reduce of every gradient; not counted ("-") for ddp_zero_redundancy
  and fsdp2.
- peak_rss_mb: ru_maxrss (a process-lifetime peak) of the rank processes that
  ran only this configuration, max over the ranks. It includes the interpreter,
  torch, the model and the data (the table header says how much that was
  before the step was built).

The bench reports; it asserts nothing about speed. Failures of a
configuration are logged, shown in the table and make the exit status 1.
Without --configs it runs DEFAULT_CONFIGS, the set of `make bench`, whose
--report writes docs/performance.md from the run (transpiler/bench/report.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import logging
import math
import os
import platform
import resource
import shlex
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from transpiler import MODES, DiLoCo, transpile
from transpiler.backends.compile import BACKENDS
from transpiler.bench.report import Row, RunInfo, Table, text, write_report
from transpiler.bench.launch import REFUSED, BenchError, failure_text, run_ranks
from transpiler.program.collectives import sent_bytes

log = logging.getLogger("transpiler.bench")

SEED_WEIGHTS, SEED_DATA = 0, 1
LR, MOMENTUM = 0.01, 0.9
LOCAL_SGD_K = 8
DILOCO_H, DILOCO_FRAGMENTS = 8, 2
# The fields of a config's result, in the table's order, and how the table formats them.
STEP_COLUMNS = (("step_ms", ".2f"), ("vs_ddp", ".2f"), ("vs_limit", ".2f"),
                ("param_mb", ".2f"), ("opt_state_mb", ".2f"), ("sent_mb", ".2f"),
                ("peak_rss_mb", ".1f"), ("peak_device_mb", ".1f"), ("setup_s", ".2f"))
FIELDS = tuple(name for name, _ in STEP_COLUMNS)
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("cpu", "cuda")
REFERENCES = ("local", "allreduce_only", "ddp")   # needed for vs_ddp and vs_limit


# ------------------------------------------------------------ models and data

class MLP(nn.Module):
    """Linear layers of the given sizes with ReLU between them."""

    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class TransformerLM(nn.Module):
    """Embedding, encoder blocks, and an output layer tied to the embedding."""

    def __init__(self, vocab=1000, d_model=128, nhead=4, dim_feedforward=256, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
                                       batch_first=True)
            for _ in range(layers))
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class GPT(nn.Module):
    """A GPT-2-shaped language model from torch's own layers: token and
    position embeddings, pre-norm causal decoder blocks (GELU), a final
    LayerNorm and an output layer tied to the token embedding."""

    def __init__(self, vocab=1000, d_model=128, nhead=4, layers=12, context=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.position(torch.arange(seq, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.out(self.norm(h))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with BatchNorm and a residual (a 1x1
    convolution where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 from torch's layers: a 7x7 stem, four stages of
    two BasicBlocks (64 to 512 channels), average pooling, a linear head."""

    def __init__(self, classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _images(size: int, n_classes: int):
    def make(g: torch.Generator, batch: int):
        return (torch.randn(batch, 3, size, size, generator=g),
                torch.randint(0, n_classes, (batch,), generator=g))
    return make


def _features(n_features: int, n_classes: int):
    def make(g: torch.Generator, batch: int):
        return (torch.randn(batch, n_features, generator=g),
                torch.randint(0, n_classes, (batch,), generator=g))
    return make


def _tokens(vocab: int, seq: int):
    def make(g: torch.Generator, batch: int):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)
    return make


def train_step(model, optimizer, inputs, targets):
    """The one user step every configuration runs (on CPU)."""
    optimizer.zero_grad()
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss


def train_step_bf16(model, optimizer, inputs, targets):
    """The one user step every configuration runs on CUDA: the forward pass
    and the loss under bf16 autocast, as nanoGPT trains."""
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss


STEPS = {"cpu": train_step, "cuda": train_step_bf16}


def train_step_amp(model, optimizer, scaler, inputs, targets):
    """The step of torchvision's classification reference with --amp and
    --clip-grad-norm: bf16 autocast, the loss scaled, unscaled before the
    gradients are clipped, an overflowing step skipped by the scaler."""
    optimizer.zero_grad()
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(inputs), targets, label_smoothing=0.1)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, int], tuple]   # a global batch of `batch` samples
    batch_per_rank: int
    # The script's own step, taking a GradScaler (made by `scaler` for the
    # device) after the optimizer; None: STEPS, or accumulating with --micro-batches.
    step: Callable | None = None
    scaler: Callable[[str], torch.amp.GradScaler] = torch.amp.GradScaler
    # The script's own optimizer; None: --optimizer's.
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None


# examples/nanogpt.py's defaults: its model, AdamW, micro-batches and clipping.
NANOGPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
NANOGPT_MICRO_BATCHES, NANOGPT_BATCH = 4, 8


def _nanogpt():
    """The example's module (from a checkout: examples/ is not installed)."""
    try:
        from examples import nanogpt
    except ImportError as exc:
        raise BenchError("model nanogpt runs examples/nanogpt.py's code: run the bench from "
                         f"the repository's root ({exc})") from exc
    return nanogpt


@functools.cache
def _nanogpt_step() -> Callable:
    return _nanogpt().make_train_step(NANOGPT_MICRO_BATCHES, 1.0, contextlib.nullcontext())


def train_step_nanogpt(model, optimizer, scaler, inputs, targets):
    """examples/nanogpt.py's step (on CPU: float32, no autocast) over this
    rank's batch cut into its micro-batches."""
    return _nanogpt_step()(model, optimizer, scaler,
                           list(zip(inputs.chunk(NANOGPT_MICRO_BATCHES),
                                    targets.chunk(NANOGPT_MICRO_BATCHES))))


def _nanogpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return model.configure_optimizers(0.1, 3e-3, (0.9, 0.95))


MODELS: dict[str, ModelSpec] = {
    # 8 x Linear(512, 512): 2.1M parameters in 16 tensors; 512 classes.
    "wide": ModelSpec(lambda: MLP([512] * 9), _features(512, 512), 32),
    # 64 x Linear(64, 64) and a Linear(64, 10) head: 130 small tensors, latency-bound.
    "deep": ModelSpec(lambda: MLP([64] * 65 + [10]), _features(64, 10), 32),
    # Parameters dominate (memory per rank): Linear(1024, 3072), Linear(3072, 3072),
    # Linear(3072, 1024), 15.7M parameters (60 MiB in float32), a batch of 8 per rank.
    "wide_mlp": ModelSpec(lambda: MLP([1024, 3072, 3072, 1024]), _features(1024, 1024), 8),
    # 2 encoder blocks (d_model 128), vocab 1000, sequences of 32 tokens.
    "transformer": ModelSpec(TransformerLM, _tokens(1000, 32), 8),
    # GPT-2's shape at 12 layers, d_model 128: a large graph (setup time), 2.5M
    # parameters in 148 tensors.
    "gpt2_12l": ModelSpec(GPT, _tokens(1000, 64), 4),
    # For --device cuda. GPT-2 124M's shape (GPT-2's vocabulary padded to a
    # multiple of 64, as nanoGPT does), 1024-token sequences.
    "gpt2_124m": ModelSpec(lambda: GPT(vocab=50304, d_model=768, nhead=12, layers=12,
                                       context=1024), _tokens(50304, 1024), 8),
    # 6 layers, d_model 256, 128-token sequences: small kernels, launch-bound on a GPU.
    "gpt_6l": ModelSpec(lambda: GPT(vocab=8192, d_model=256, nhead=4, layers=6, context=128),
                        _tokens(8192, 128), 16),
    # torchvision's classification reference at 48 px: resnet18 (11.2M parameters
    # in 62 tensors, BatchNorm), bf16 autocast, GradScaler, clipping, label smoothing.
    "resnet18": ModelSpec(ResNet18, _images(48, 100), 8, step=train_step_amp),
    # examples/nanogpt.py with its defaults: a 2-layer GPT (d_model 64, vocab 256,
    # 64-token sequences), 4 micro-batches of 8 sequences per step.
    "nanogpt": ModelSpec(lambda: _nanogpt().GPT(**NANOGPT),
                         _tokens(NANOGPT["vocab_size"], NANOGPT["block_size"]),
                         NANOGPT_MICRO_BATCHES * NANOGPT_BATCH, step=train_step_nanogpt,
                         scaler=lambda device: torch.amp.GradScaler(device, enabled=False),
                         optimizer=_nanogpt_optimizer),
}
# Run when --models is not given: gpt2_12l is for setup time, and slow to set up.
DEFAULT_MODELS = ("wide", "deep", "transformer", "resnet18", "nanogpt")


def accumulating(k: int, device: str) -> Callable:
    """The step over k micro-batches (--micro-batches): backward() on each
    k-th of the batch, one update; on CUDA the forward passes under bf16
    autocast. DDP with its defaults averages at every backward(); mode fsdp
    sums the micro-batches' gradients and reduce-scatters once."""
    def train_step_micro(model, optimizer, inputs, targets):
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(inputs.chunk(k), targets.chunk(k)):
            with (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda"
                  else contextlib.nullcontext()):
                logits = model(xs)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)) / k
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total
    return train_step_micro


def rank_batches(spec: ModelSpec, n: int, rank: int, world_size: int) -> list[tuple]:
    """This rank's shards of `n` seeded global batches, the same in every config."""
    g = torch.Generator().manual_seed(SEED_DATA)
    batches = [spec.make_batch(g, spec.batch_per_rank * world_size) for _ in range(n)]
    return [tuple(t.chunk(world_size)[rank] for t in b) for b in batches]


# ------------------------------------------------------------ configurations
# A builder takes the user's step function, the model and its optimizer and
# returns the step: a callable of (inputs, targets).

Builder = Callable[[Callable, nn.Module, torch.optim.Optimizer], Callable]


def _local(step_fn, model, optimizer):
    return functools.partial(step_fn, model, optimizer)


def _allreduce_only(step_fn, model, optimizer):
    buffer = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad),
                         device=next(model.parameters()).device)
    return lambda *batch: dist.all_reduce(buffer)


def _ddp(step_fn, model, optimizer):
    return functools.partial(step_fn, DDP(model), optimizer)


def _powersgd_state(rank: int) -> PowerSGDState:
    """torch's PowerSGD at matrix rank `rank`, compressing after 2 plain
    steps (within the warm-up), error feedback and warm start on."""
    return PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)


def _transpiled_powersgd(rank: int) -> Builder:
    """fuse_all_reduce with torch's powerSGD_hook at matrix rank `rank`."""
    def build(step_fn, model, optimizer):
        step = transpile(step_fn, mode="fuse_all_reduce",
                         comm_hook=(_powersgd_state(rank), powerSGD_hook))
        return functools.partial(step, model, optimizer)
    return build


def _ddp_compiled(step_fn, model, optimizer):
    return functools.partial(step_fn, torch.compile(DDP(model)), optimizer)


def _ddp_zero_redundancy(step_fn, model, optimizer):
    """torch's sharded optimizer under DDP: each rank keeps and updates the
    state of its share of the parameters, then broadcasts them."""
    # The defaults the constructor takes (AdamW's record decoupled_weight_decay,
    # which its constructor sets itself).
    takes = inspect.signature(type(optimizer)).parameters
    sharded = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(optimizer),
                                      **{k: v for k, v in optimizer.defaults.items() if k in takes})
    return functools.partial(step_fn, DDP(model), sharded)


def fsdp2_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules fully_shard wraps before the root: each layer of a
    ModuleList child and each other child, where it holds parameters and
    shares none with another of them (a tied embedding and output layer stay
    with the root, as FSDP2 requires of shared parameters)."""
    candidates = [m for child in model.children()
                  for m in (child if isinstance(child, nn.ModuleList) else (child,))]
    holders = collections.Counter(id(p) for m in candidates for p in m.parameters())
    return [m for m in candidates
            if any(True for _ in m.parameters()) and all(holders[id(p)] == 1
                                                         for p in m.parameters())]


def _fsdp2(step_fn, model, optimizer):
    """torch's FSDP2 on a one-dimensional mesh of every rank, per block, then
    the root (default reshard_after_forward). fully_shard replaces each
    parameter by a DTensor of the same name; the optimizer (no state yet) is
    pointed at those, so that nothing keeps the full parameters alive."""
    names = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in fsdp2_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return functools.partial(step_fn, model, optimizer)


def _transpiled(mode: str, then: tuple[str, ...] = (), **options) -> Builder | None:
    """A transpiler configuration: the mode, or its passes followed by `then`;
    None where the mode or backend does not exist."""
    if mode not in MODES or options.get("backend", "eager") not in BACKENDS:
        return None
    chosen = {"passes": MODES[mode] + then} if then else {"mode": mode}

    def build(step_fn, model, optimizer):
        return functools.partial(transpile(step_fn, **chosen, **options), model, optimizer)
    return build


def _diloco(**options) -> Builder:
    """Mode diloco, sync_every=DILOCO_H, the paper's outer optimizer (SGD, lr
    0.7, Nesterov momentum 0.9) over the model's parameters."""
    def build(step_fn, model, optimizer):
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return functools.partial(transpile(step_fn, mode=DiLoCo(
            outer_optimizer=outer, sync_every=DILOCO_H, **options)), model, optimizer)
    return build


_ALL_CONFIGS: dict[str, Builder | None] = {
    "local": _local,
    "allreduce_only": _allreduce_only,
    "ddp": _ddp,
    "ddp_compiled": _ddp_compiled,
    "ddp_zero_redundancy": _ddp_zero_redundancy,
    "fsdp2": _fsdp2,
    "grad_allreduce": _transpiled("grad_allreduce"),              # nrings=2, the default
    "grad_allreduce_nrings1": _transpiled("grad_allreduce", nrings=1),
    "fuse_all_reduce": _transpiled("fuse_all_reduce"),
    "local_sgd": _transpiled("local_sgd", k_steps=LOCAL_SGD_K),
    "diloco": _diloco(),
    "diloco+bf16": _diloco(fuse_dtype=torch.bfloat16),
    "streaming_diloco": _diloco(fragments=DILOCO_FRAGMENTS,
                                fragment_sync_delay=DILOCO_H // DILOCO_FRAGMENTS - 1),
    "fuse_all_reduce+inductor": _transpiled("fuse_all_reduce", backend="inductor"),
    "fuse_all_reduce+powersgd1": _transpiled_powersgd(1),
    "fuse_all_reduce+powersgd4": _transpiled_powersgd(4),
    "fuse_all_reduce+cudagraphs": _transpiled("fuse_all_reduce", backend="cudagraphs"),
    "zero+cudagraphs": _transpiled("zero", backend="cudagraphs"),
    "local_sgd+cudagraphs": _transpiled("local_sgd", k_steps=LOCAL_SGD_K, backend="cudagraphs"),
    "fuse_all_reduce+schedule_updates": _transpiled("fuse_all_reduce", ("schedule_updates",)),
    "fuse_all_reduce+hierarchical": _transpiled("fuse_all_reduce", hierarchical=True),
    "zero": _transpiled("zero"),
    "fsdp": _transpiled("fsdp"),
    "fsdp+keep_gathered": _transpiled("fsdp", reshard_after_forward=False),
    "fsdp+inductor": _transpiled("fsdp", backend="inductor"),
    "fsdp+hierarchical": _transpiled("fsdp", hierarchical=True),
    "all_gather": _transpiled("all_gather"),
    "decentralized": _transpiled("decentralized", topology="ring"),
}
CONFIGS: dict[str, Builder] = {k: v for k, v in _ALL_CONFIGS.items() if v is not None}
# Steps per timed sample: local SGD's steps differ (k-1 local, then a sync), so a
# sample is a whole period and step_ms its time divided by k.
PERIOD: dict[str, int] = {"local_sgd": LOCAL_SGD_K, "local_sgd+cudagraphs": LOCAL_SGD_K,
                          "diloco": DILOCO_H, "diloco+bf16": DILOCO_H, "streaming_diloco": DILOCO_H}
# Configurations that run only with --device cuda.
CUDA_ONLY = tuple(c for c in CONFIGS if c.endswith("+cudagraphs"))
# Run when --configs is not given (the set of `make bench`'s report): the limits,
# torch's DDP, compiled and with ZeroRedundancyOptimizer, FSDP2, every transpiler mode,
# fuse_all_reduce and fsdp under inductor; and with --device cuda, CUDA_ONLY.
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c in {
    "local", "allreduce_only", "ddp", "ddp_compiled", "ddp_zero_redundancy", "fsdp2",
    "grad_allreduce", "fuse_all_reduce", "fuse_all_reduce+inductor", "local_sgd", "diloco",
    "diloco+bf16", "streaming_diloco", "zero", "fsdp",
    "fsdp+inductor", "all_gather", "decentralized"})


# ------------------------------------------------------------ one configuration, in a rank

@dataclasses.dataclass(frozen=True)
class Job:
    model: str
    config: str
    warmup: int
    steps: int
    optimizer: str = "sgd"
    device: str = "cpu"
    micro_batches: int = 1


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def _between_barriers(fn, *args) -> tuple[Any, float]:
    """fn(*args) between two barriers: its result and its time on this rank."""
    dist.barrier()
    start = time.perf_counter()
    result = fn(*args)
    elapsed = time.perf_counter() - start
    dist.barrier()
    return result, elapsed


def job_setup(job: Job, rank: int, world_size: int, calls: int):
    """This rank's model, optimizer, `calls` batches (each with the scaler
    first where the model's step takes one) and the configuration's step,
    not yet called."""
    spec = MODELS[job.model]
    torch.manual_seed(SEED_WEIGHTS)
    model = spec.build().to(job.device)
    optimizer = (spec.optimizer or functools.partial(_optimizer, job.optimizer))(model)
    batches = [tuple(t.to(job.device) for t in batch)
               for batch in rank_batches(spec, calls, rank, world_size)]
    if spec.step is not None:   # the scaler, between the optimizer and the batch
        scaler = spec.scaler(job.device)
        batches = [(scaler, *batch) for batch in batches]
    step_fn = spec.step or (STEPS[job.device] if job.micro_batches == 1
                            else accumulating(job.micro_batches, job.device))
    return model, optimizer, batches, functools.partial(CONFIGS[job.config], step_fn, model,
                                                        optimizer)


def measure(job: Job, rank: int, world_size: int) -> dict[str, Any]:
    """Run one configuration on this rank; its own times, not yet combined."""
    model, optimizer, batches, make_step = job_setup(job, rank, world_size,
                                                     1 + job.warmup + job.steps)
    base_rss = _rss_mb()

    def build_and_first_call():
        step = make_step()
        step(*batches[0])
        _synchronize(job.device)
        return step

    step, setup_s = _between_barriers(build_and_first_call)
    built_s = _build_seconds(step)
    period = PERIOD.get(job.config, 1)
    sent_before = _bytes_sent(step)

    by_program: dict[str, list[float]] = collections.defaultdict(list)

    def sample(i):
        for j in range(i * period, (i + 1) * period):
            start = time.perf_counter()
            step(*batches[1 + j % (len(batches) - 1)])
            if period > 1 and i >= job.warmup:   # a schedule's steps differ: each timed alone
                _synchronize(job.device)
                by_program[_transpiled_step(step).program.name].append(time.perf_counter() - start)
        _synchronize(job.device)

    times = [_between_barriers(sample, i)[1] / period for i in range(job.warmup + job.steps)]
    if job.config in SENT:
        sent = SENT[job.config](model, world_size)
    else:
        after = _bytes_sent(step)
        sent = None if after is None else (after - sent_before) / (len(times) * period)
    setup_s += _build_seconds(step) - built_s   # programs built during the warm-up
    split = getattr(_transpiled_step(step), "setup_split", None)
    return {"setup_s": setup_s, "step_s": times[job.warmup:], "peak_rss_mb": _rss_mb(),
            "base_rss_mb": base_rss, "setup_split": split,
            "peak_device_mb": (torch.cuda.max_memory_allocated() / 2**20
                               if job.device == "cuda" else None),
            "param_mb": (param_bytes(model) + getattr(_transpiled_step(step),
                                                      "parameter_shard_bytes", 0)) / 2**20,
            "opt_state_mb": _state_bytes(getattr(step, "args", (optimizer,))[-1]) / 2**20,
            "sent_mb": None if sent is None else sent / 2**20,
            "program_s": {name: statistics.median(ts) for name, ts in by_program.items()}}


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=LR)


def _synchronize(device: str) -> None:
    """Wait for the device's queued work (a CUDA step returns before it ends)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a DTensor's local shard, or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def param_bytes(model: nn.Module) -> int:
    """Bytes of the storages of the model's parameters as this rank holds
    them, each storage once (a DTensor's local shard's, with its padding; mode
    fsdp's parameters hold none: its shards are counted apart)."""
    storages = {}
    for p in model.parameters():
        storage = _local(p).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _state_bytes(optimizer) -> int:
    """Bytes of the optimizer state tensors this process holds (for torch's
    ZeroRedundancyOptimizer, its local optimizer's; for DTensors, the local
    shards: each its rank's share)."""
    state = getattr(optimizer, "optim", optimizer).state
    return sum(_local(v).nbytes for entries in state.values() for v in entries.values()
               if isinstance(v, torch.Tensor))


def _bytes_sent(step) -> float | None:
    """What a transpiled step's rank has sent so far (None for the others)."""
    return getattr(_transpiled_step(step), "bytes_sent", None)


def _all_reduced_gradients(model, world_size: int) -> float:
    """What one rank sends to all-reduce every gradient (collectives.sent_bytes)."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return sent_bytes("all_reduce", nbytes, world_size)


# What a rank sends per step, for the configurations that are not transpiled
# (those count their programs' collectives); the others report none.
SENT = {"local": lambda model, world_size: 0.0, "ddp": _all_reduced_gradients,
        "ddp_compiled": _all_reduced_gradients, "allreduce_only": _all_reduced_gradients}


def _transpiled_step(step):
    """The TranspiledStep a configuration's step calls (None for the others)."""
    return getattr(step, "func", None)


def _build_seconds(step) -> float:
    """Time a transpiled step has spent building programs so far (0 for others)."""
    return getattr(_transpiled_step(step), "build_seconds", 0.0)


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """os.environ[name] = value (None: unchanged) for the ranks spawned inside,
    which inherit the environment."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _cold_inductor_cache():
    """A fresh inductor cache for the ranks spawned inside."""
    with tempfile.TemporaryDirectory(prefix="transpiler-bench-inductor-") as tmp:
        with _environment("TORCHINDUCTOR_CACHE_DIR", tmp):
            yield


# ------------------------------------------------------------ the run

@dataclasses.dataclass
class Measurement:
    step_ms: float
    setup_s: float
    peak_rss_mb: float
    base_rss_mb: float
    setup_split: dict[str, float] | None = None   # the transpiler's setup by phase
    param_mb: float = 0.0
    opt_state_mb: float = 0.0
    sent_mb: float | None = None   # what a rank sends per step (None: not counted)
    peak_device_mb: float | None = None   # torch.cuda.max_memory_allocated (None: CPU)
    # a schedule's programs (PERIOD): the median time of a step that runs each, ms
    program_ms: dict[str, float] = dataclasses.field(default_factory=dict)


def combine(per_rank: list[dict]) -> Measurement:
    """Slowest rank per step, median over steps; slowest setup (with that
    rank's split by phase); largest RSS."""
    slowest = [max(steps) for steps in zip(*(r["step_s"] for r in per_rank))]
    slowest_setup = max(per_rank, key=lambda r: r["setup_s"])
    return Measurement(step_ms=statistics.median(slowest) * 1e3,
                       setup_s=slowest_setup["setup_s"],
                       peak_rss_mb=max(r["peak_rss_mb"] for r in per_rank),
                       base_rss_mb=max(r["base_rss_mb"] for r in per_rank),
                       setup_split=slowest_setup.get("setup_split"),
                       param_mb=max(r["param_mb"] for r in per_rank),
                       opt_state_mb=max(r["opt_state_mb"] for r in per_rank),
                       sent_mb=_max_or_none(r["sent_mb"] for r in per_rank),
                       peak_device_mb=_max_or_none(r["peak_device_mb"] for r in per_rank),
                       program_ms={name: max(r["program_s"][name] for r in per_rank) * 1e3
                                   for name in per_rank[0]["program_s"]})


def _max_or_none(values) -> float | None:
    values = list(values)
    return None if None in values else max(values)


def rounds(items: list, repeat: int, label: Callable[[Any], str],
           failed: Callable[[Any], bool]) -> Iterator[tuple[int, Any, str]]:
    """`repeat` rounds of the whole list of `items` (so that a machine whose
    speed drifts affects every one alike): (round, item, the tag of its log
    lines), an item that failed in an earlier round left out."""
    for r in range(1, repeat + 1):
        for i, item in enumerate(items, 1):
            if not failed(item):
                yield r, item, (f"[{i}/{len(items)}]" + (f" round {r}/{repeat}" if repeat > 1
                                                         else "") + f" {label(item)}")


def run_bench(models: list[str], configs: list[str], *, world_size: int, steps: int,
              warmup: int, repeat: int = 1, nodes: int = 1, optimizer: str = "sgd",
              device: str = "cpu", micro_batches: int = 1) -> dict[str, dict[str, Measurement | str]]:
    """Every config on every model, each in fresh ranks, `repeat` rounds of the
    whole list (so that a machine whose speed drifts affects every config
    alike): a Measurement whose step_ms is the median over the rounds and whose
    setup_s is the first round's (cold compile caches), or the error text of a
    failed configuration. With `nodes` > 1 the ranks are told that they run on
    that many nodes (LOCAL_WORLD_SIZE), which only hierarchical reductions read."""
    jobs = [Job(m, c, warmup, steps, optimizer, device, micro_batches)
            for m in models for c in configs]
    measured: dict[Job, list[Measurement]] = {job: [] for job in jobs}
    out: dict[str, dict[str, Measurement | str]] = {m: {} for m in models}
    local = str(world_size // nodes) if nodes > 1 else None
    with _cold_inductor_cache(), _environment("LOCAL_WORLD_SIZE", local):
        for _, job, tag in rounds(jobs, repeat, lambda job: f"{job.model} {job.config}",
                                  lambda job: isinstance(out[job.model].get(job.config), str)):
            log.info("%s ...", tag)
            start = time.perf_counter()
            try:
                m = combine(run_ranks(job, world_size, measure))
            except BenchError as exc:
                out[job.model][job.config] = failure_text(exc)
                log.error("%s %s", tag, out[job.model][job.config])
                continue
            measured[job].append(m)
            log.info("%s: %.2f ms/step, setup %.2fs (%.1fs in all)", tag, m.step_ms,
                     m.setup_s, time.perf_counter() - start)
    for job, ms in measured.items():
        if ms and job.config not in out[job.model]:
            out[job.model][job.config] = Measurement(
                step_ms=statistics.median(m.step_ms for m in ms), setup_s=ms[0].setup_s,
                peak_rss_mb=max(m.peak_rss_mb for m in ms),
                base_rss_mb=max(m.base_rss_mb for m in ms), setup_split=ms[0].setup_split,
                param_mb=max(m.param_mb for m in ms),
                opt_state_mb=max(m.opt_state_mb for m in ms), sent_mb=ms[0].sent_mb,
                peak_device_mb=_max_or_none(m.peak_device_mb for m in ms),
                program_ms={name: statistics.median(m.program_ms[name] for m in ms)
                            for name in ms[0].program_ms})
    return {m: {c: out[m][c] for c in configs if c in out[m]} for m in models}


def _ratio(value: float, reference: float | None) -> float | None:
    return value / reference if reference else None


def summarize(raw: dict[str, dict[str, Measurement | str]]) -> dict[str, dict[str, dict]]:
    """The JSON "models" section: the fields of FIELDS for each measured config."""
    summary = {}
    for model, results in raw.items():
        ok = {c: m for c, m in results.items() if isinstance(m, Measurement)}
        ddp = ok["ddp"].step_ms if "ddp" in ok else None
        limits = [ok[c].step_ms for c in ("local", "allreduce_only") if c in ok]
        limit = max(limits) if len(limits) == 2 else None
        summary[model] = {c: {"step_ms": m.step_ms, "vs_ddp": _ratio(m.step_ms, ddp),
                              "vs_limit": _ratio(m.step_ms, limit),
                              "param_mb": m.param_mb, "opt_state_mb": m.opt_state_mb,
                              "sent_mb": m.sent_mb,
                              "peak_rss_mb": m.peak_rss_mb,
                              "peak_device_mb": m.peak_device_mb, "setup_s": m.setup_s,
                              **({"setup_split": m.setup_split} if m.setup_split else {}),
                              **({"program_ms": m.program_ms} if m.program_ms else {})}
                          for c, m in ok.items()}
    return summary


# ------------------------------------------------------------ output

def run_info(argv: list[str], world_size: int, nodes: int, optimizer: str,
             device: str) -> RunInfo:
    """The machine, torch and the command line, taken at the start of the run."""
    return RunInfo(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   command=shlex.join(["python", "-m", "transpiler.bench", *argv]),
                   platform=platform.platform(), machine=platform.machine(),
                   cpus=os.cpu_count() or 0, load=os.getloadavg()[0], torch=torch.__version__,
                   device=device, ranks=_cuda_text(world_size) if device == "cuda"
                   else "gloo, CPU, 1 thread/rank",
                   world_size=world_size, nodes=nodes, optimizer=optimizer)


def _cuda_text(world_size: int) -> str:
    gpus = torch.cuda.device_count()
    return (f"{'nccl' if world_size <= gpus else 'gloo'}, {torch.cuda.get_device_name()} "
            f"x {min(gpus, world_size)}, CUDA {torch.version.cuda}, forward and loss under bf16 "
            "autocast")


def header_lines(info: RunInfo, steps: int, warmup: int, raw: dict,
                 repeat: int = 1) -> list[str]:
    """The lines printed above the table: the run, then what each field is
    (the report lists those as its definitions)."""
    base = [m.base_rss_mb for r in raw.values() for m in r.values() if isinstance(m, Measurement)]
    base_text = f"{min(base):.0f}-{max(base):.0f} MB" if base else "n/a"
    nodes = info.nodes
    return [
        f"# transpiler.bench  {info.date}  torch {info.torch}  world_size {info.world_size}  "
        + (f"simulated nodes {nodes} x {info.world_size // nodes}  " if nodes > 1 else "")
        + f"optimizer {info.optimizer}  {info.machine_text()}",
        f"# step_ms: median over {steps} timed steps (after {warmup} warm-up) of the slowest "
        f"rank's time for the step, each step between dist.barrier()s; {info.ranks}"
        + ("; peak_device_mb: torch.cuda.max_memory_allocated, max over ranks"
           if info.device == "cuda" else "")
        + (f"; median of {repeat} interleaved rounds" if repeat > 1 else ""),
        "# vs_ddp = step_ms / ddp;  vs_limit = step_ms / max(local, allreduce_only)",
        "# param_mb, opt_state_mb: the model's parameters (their storages) and the optimizer "
        "state a rank holds between steps (a DTensor: its local shard), max over ranks",
        "# peak_rss_mb: ru_maxrss of fresh rank processes that ran only this config, max over "
        f"ranks (includes python, torch, model, data: {base_text} before the step was built)",
        "# setup_s: building the step + its first call, slowest rank (ddp: DDP construction; "
        "ddp_compiled: cold compile; transpiler: every trace + passes + startup)",
    ]


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def step_table(raw: dict, summary: dict) -> Table:
    """A row per model and config: the fields of STEP_COLUMNS, or the failure."""
    rows = tuple(Row((model, config) + tuple(_cell(summary[model][config][n], f)
                                             for n, f in STEP_COLUMNS))
                 if isinstance(m, Measurement) else Row((model, config), m)
                 for model, results in raw.items() for config, m in results.items())
    return Table(("model", "config") + FIELDS, 2, rows)


def program_table(raw: dict) -> Table | None:
    """A row per program of each schedule's configuration (PERIOD): the median
    time of a step that runs it, and that over a local step's; None when none ran."""
    rows = []
    for model, results in raw.items():
        for config, m in results.items():
            if not isinstance(m, Measurement) or not m.program_ms:
                continue
            local = m.program_ms.get("local")
            rows += [Row((model, config, name, f"{ms:.2f}", _cell(_ratio(ms, local), ".2f")))
                     for name, ms in sorted(m.program_ms.items())]
    return Table(("model", "config", "program", "step_ms", "vs_local_step"), 3,
                 tuple(rows)) if rows else None


SETUP_PHASES = ("trace", "passes", "agreement", "compile", "other")


def setup_table(raw: dict) -> Table | None:
    """setup_s of the transpiler's configurations by phase (first round); None
    when none ran."""
    rows = tuple(Row((model, config, f"{m.setup_s:.2f}")
                     + tuple(f"{m.setup_split[p]:.2f}" for p in SETUP_PHASES))
                 for model, results in raw.items() for config, m in results.items()
                 if isinstance(m, Measurement) and m.setup_split)
    return Table(("model", "config", "setup_s") + tuple(p + "_s" for p in SETUP_PHASES),
                 2, rows) if rows else None


def _json_value(x):
    return None if x is None or isinstance(x, float) and not math.isfinite(x) else x


def write_json(path: str, info: RunInfo, summary: dict) -> None:
    def value(x):
        return {k: _json_value(v) for k, v in x.items()} if isinstance(x, dict) else _json_value(x)
    doc = {"world_size": info.world_size, "torch": info.torch, "run": dataclasses.asdict(info),
           "models": {m: {c: {k: value(v) for k, v in f.items()} for c, f in cs.items()}
                      for m, cs in summary.items()}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def pyplot():
    """matplotlib.pyplot (Agg), imported only for plots: matplotlib is an optional extra."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib, an optional extra: "
                         "pip install -e .[bench]") from None
    return plt


def plot(path: str, summary: dict, title: str) -> None:
    """One panel per model, one bar per configuration: step time in ms."""
    plt = pyplot()
    models = [m for m in summary if summary[m]]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4.5),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        names = list(summary[model])
        values = [summary[model][c]["step_ms"] for c in names]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(model)
        ax.set_ylabel("step time (ms, median)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------ command line

def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise BenchError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    return names


def _with_references(configs: list[str]) -> list[str]:
    missing = [c for c in REFERENCES if c not in configs]
    if missing:
        log.info("also running %s: the references of vs_ddp and vs_limit", ", ".join(missing))
    chosen = set(configs) | set(REFERENCES)
    return [c for c in CONFIGS if c in chosen]


def check_writable(*paths: str | None) -> None:
    """Refuse, before any configuration runs, an output whose directory does not exist."""
    for path in paths:
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise BenchError(f"cannot write {path}: its directory does not exist")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m transpiler.bench",
                                description="Time the transpiler's data-parallel step "
                                            "against torch DDP (CPU, gloo).")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes the ranks are split into (LOCAL_WORLD_SIZE), for "
                        "hierarchical reductions (default 1)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated, of {', '.join(MODELS)} "
                        f"(default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps after the first call (default 5)")
    p.add_argument("--configs",
                   help=f"comma-separated, of {', '.join(CONFIGS)}; or 'all' (every config "
                        f"that runs on the device); default {', '.join(DEFAULT_CONFIGS)} "
                        "(and with --device cuda, the cudagraphs ones)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of the whole list of configs; step_ms is the median over "
                        "them (default 1)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="SGD with momentum (default), Adam or AdamW, whose state is twice "
                        "the model (nanogpt keeps its script's AdamW)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="backward() on each of this many parts of the batch, then one "
                        "update (default 1)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the models run (default cpu); cuda: a GPU per rank on nccl, "
                        "or ranks sharing GPUs on gloo, the forward pass under bf16 autocast, "
                        f"and the configs {', '.join(CUDA_ONLY)}")
    p.add_argument("--timeline", metavar="MODEL",
                   help="when each all-reduce of one step is issued, run and waited for, on "
                        "MODEL, for --configs (default ddp,fuse_all_reduce): "
                        "transpiler/bench/timeline.py")
    p.add_argument("--varying-shapes", action="store_true",
                   help="run the varying-shapes workload instead (transpiler/bench/shapes.py: "
                        "a 2-layer LM, 12 calls over 10 batch shapes; traces, compiles, setup "
                        "and step time against a static program); takes --configs, "
                        "--world-size, --steps, --warmup, --json, --report")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG bar chart (needs matplotlib; with --report and no "
                        "matplotlib, the report says there is no plot)")
    p.add_argument("--report", metavar="PATH",
                   help="write the run (machine, torch, device, command line), its tables "
                        "and the fields' definitions as Markdown (docs/performance.md)")
    return p.parse_args(argv)


def _configs(args: argparse.Namespace) -> list[str]:
    on_device = [c for c in CONFIGS if args.device == "cuda" or c not in CUDA_ONLY]
    if args.configs == "all":
        return on_device
    if args.configs:
        return _names(args.configs, CONFIGS, "config")
    return [c for c in on_device if c in DEFAULT_CONFIGS or c in CUDA_ONLY]


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """The default run (cli.py parsed `argv` into `args`): 0, 1 if a
    configuration failed (not refused: a configuration the transpiler refuses
    for a model is a result), 2 on a usage error."""
    try:
        models = _names(args.models, MODELS, "model")
        configs = _with_references(_configs(args))
        if args.device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: no CUDA device is available")
        on_gpu = [c for c in configs if c in CUDA_ONLY and args.device != "cuda"]
        if on_gpu:
            raise BenchError(f"{', '.join(on_gpu)} run only with --device cuda")
        if args.world_size < 1 or args.steps < 1 or args.warmup < 0 or args.repeat < 1 \
                or args.micro_batches < 1:
            raise BenchError("need --world-size >= 1, --steps >= 1, --warmup >= 0, "
                             "--repeat >= 1 and --micro-batches >= 1")
        own = [m for m in models if MODELS[m].step is not None]
        if own and args.micro_batches != 1:
            raise BenchError(f"--micro-batches with {', '.join(own)}: it runs its script's own "
                             "step; leave it out of --models")
        if args.nodes < 1 or args.world_size % args.nodes:
            raise BenchError(f"--nodes {args.nodes} must divide --world-size {args.world_size}")
        check_writable(args.json, args.plot, args.report)
        plot_path = args.plot
        if plot_path:
            try:
                pyplot()      # fail now, not after minutes of benchmarking
            except BenchError as exc:
                if not args.report:
                    raise
                log.warning("no plot: %s; the report will say so", exc)
                plot_path = None
    except BenchError as exc:
        log.error("error: %s", exc)
        return 2
    start = time.perf_counter()
    info = run_info(argv, args.world_size, args.nodes, args.optimizer, args.device)
    raw = run_bench(models, configs, world_size=args.world_size, steps=args.steps,
                    warmup=args.warmup, repeat=args.repeat, nodes=args.nodes,
                    optimizer=args.optimizer, device=args.device,
                    micro_batches=args.micro_batches)
    elapsed_s = time.perf_counter() - start
    summary = summarize(raw)
    header = header_lines(info, args.steps, args.warmup, raw, args.repeat)
    tables = [("Step time", step_table(raw, summary))]
    by_program = program_table(raw)
    if by_program:
        tables.append(("Step time by program (schedules of several programs)", by_program))
    setup = setup_table(raw)
    if setup:
        tables.append(("setup_s of the transpiler by phase (runtime.setup_split)", setup))
    printed = header + [text(tables[0][1])]
    for title, table in tables[1:]:
        printed += ["", f"# {title}", text(table)]
    print("\n".join(printed), flush=True)
    log.info("bench finished in %.1fs", elapsed_s)
    if args.json:
        write_json(args.json, info, summary)
    if plot_path:
        plot(plot_path, summary, header[0].lstrip("# "))
    if args.report:
        write_report(args.report, info, [h.removeprefix("# ") for h in header[1:]], tables,
                     plot_path, "No plot: " + ("matplotlib is not installed "
                                               "(pip install -e .[bench])" if args.plot
                                               else "the run was given no --plot") + ".",
                     elapsed_s)
    failed = any(isinstance(m, str) and not m.startswith(REFUSED)
                 for r in raw.values() for m in r.values())
    return 1 if failed else 0
