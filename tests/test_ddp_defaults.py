"""DDP's defaults, exactly: torch DDP with its defaults running the same step
function in the same processes (2 gloo ranks, each on its own shard of the
batch) against the transpiled step. BatchNorm's buffers are rank 0's at every
forward (broadcast_buffers=True): DDP broadcasts them before each forward
through its wrapper, a training step's or an evaluation's; the transpiled step
ends by broadcasting what it wrote, so a forward between steps (an evaluation
with the module) sees what DDP's would. Off with broadcast_buffers=False, as
DDP's option. The gradients of a backward() that the step reads before the
next one (SAM) are averaged where it ends, as DDP averages at every backward();
pure accumulation is reduced once, as under no_sync()."""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile
from transpiler.program.program import InputKind
from transpiler.program.roles import Role

STEPS = 4
BATCH = 12


def _state(model, opt, step=None) -> dict:
    """Parameters, buffers and the optimizer's full state (mode zero's
    gathered from its shards), by name."""
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    full = step.full_optimizer_state_dict(opt) if step is not None else opt.state_dict()
    for i, entry in full["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                state[f"opt.{i}.{key}"] = value.clone()
    return state


def _ddp(model, broadcast_buffers: bool):
    if broadcast_buffers:
        return DDP(model)
    with warnings.catch_warnings():   # deprecated in torch 2.13 for forward_sync_buffers
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, broadcast_buffers=False)


def rank_bn_vs_ddp(mode, backend, broadcast_buffers, ddp_broadcasts):
    """BatchNorm model, SGD with momentum, 4 steps: the transpiled step (its
    model starts from another seed on each rank: the startup broadcast aligns
    them) and DDP, then an evaluation forward on a batch of this rank's (the
    module itself; DDP's through its wrapper, which first broadcasts rank 0's
    buffers); each with its state on this rank after the evaluation and the
    evaluation's output."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", STEPS, BATCH)]
    model = M.make("bn", seed=rank)
    opt = M.make_optimizer("sgd", model)
    options = {} if broadcast_buffers is None else {"broadcast_buffers": broadcast_buffers}
    step = transpile(M.classify_step, mode=mode, backend=backend, **options)
    for batch in batches:
        step(model, opt, *batch)
    held_out = batches[0][0] + 1
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        ours = _state(model, opt, step), M.evaluated(model, held_out)
    ops = [n.meta["comm"].op for n in step.program.collectives()]

    model = M.make("bn", seed=0)
    opt = M.make_optimizer("sgd", model)
    ddp = _ddp(model, ddp_broadcasts)
    for batch in batches:
        M.classify_step(ddp, opt, *batch)
    evaluated = M.evaluated(ddp, held_out)
    return ours[0], _state(model, opt), ops, ours[1], evaluated


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero", "fsdp"])
def test_batchnorm_and_an_evaluation_after_it_equal_ddp_defaults(mode, ranks2):
    results = ranks2.run(rank_bn_vs_ddp, mode, "eager", None, True)
    for ours, ddp, ops, evaluated, ddp_evaluated in results:
        M.assert_states_equal(ours, ddp)
        assert torch.equal(evaluated, ddp_evaluated)
        # the statistics (f32) and the batch count (i64): one broadcast each
        assert ops.count("broadcast") == 2
    # Every rank evaluates with rank 0's statistics; rank 1's own (updated on
    # its batch by the last step) were not: its evaluation would differ.
    assert torch.equal(results[0][0]["model.bn.running_mean"],
                       results[1][0]["model.bn.running_mean"])


def test_batchnorm_under_inductor_equals_ddp_defaults(ranks2):
    """Inductor's kernels round differently from eager's (test_training_loops
    bounds that at 1e-5); without the broadcast rank 1's statistics would be
    0.09 off."""
    for ours, ddp, ops, evaluated, ddp_evaluated in ranks2.run(
            rank_bn_vs_ddp, "fuse_all_reduce", "inductor", None, True):
        assert M.max_rel_error(ours, ddp) <= 1e-5
        assert M.max_rel_error({"out": evaluated}, {"out": ddp_evaluated}) <= 1e-5
        assert ops.count("broadcast") == 2


def test_broadcast_buffers_false_equals_ddp_without_it(ranks2):
    for ours, ddp, ops, evaluated, ddp_evaluated in ranks2.run(
            rank_bn_vs_ddp, "fuse_all_reduce", "eager", False, False):
        M.assert_states_equal(ours, ddp)
        assert torch.equal(evaluated, ddp_evaluated)
        assert "broadcast" not in ops


def test_without_the_broadcast_rank_1_differs_from_ddp_defaults(ranks2):
    """What the broadcast fixes: the test above can fail."""
    (ours0, ddp0, *_), (ours1, ddp1, *_) = ranks2.run(rank_bn_vs_ddp, "grad_allreduce", "eager",
                                                      False, True)
    M.assert_states_equal(ours0, ddp0)   # rank 0 broadcasts its own buffers: no difference
    assert not torch.equal(ours1["model.bn.running_mean"], ddp1["model.bn.running_mean"])


class Masked(torch.nn.Module):
    """A buffer only the forward reads (a mask), beside BatchNorm's."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(16)
        self.register_buffer("mask", torch.ones(4, 16).tril())

    def forward(self, x):
        return torch.nn.functional.linear(self.bn(x), self.fc.weight * self.mask, self.fc.bias)


def test_only_the_buffers_the_step_writes_are_broadcast():
    from passes.broadcast_buffers import broadcast_buffers
    from tests.test_passes import CTX
    from transpiler.capture import flatten_args, trace_step

    model = Masked()
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("bn", 1, 8)[0]
    program = trace_step(M.classify_step, flatten_args(M.classify_step, (model, opt, x, y), {})).program
    broadcast_buffers(program, CTX)
    sent = [n.meta["comm"].params for n in program.collectives()]
    assert sent == [("bn.running_mean", "bn.running_var"), ("bn.num_batches_tracked",)]
    # the program outputs what rank 0 sent in place of each written buffer
    outputs = dict(zip((s.target for s in program.outputs), program.output_node.args[0]))
    for node in program.placeholders:
        spec = node.meta["input"]
        if spec.kind is InputKind.BUFFER and spec.name != "mask":
            assert outputs[spec.name].meta["role"] is Role.COMM, spec.name
    assert "mask" not in outputs


@pytest.mark.parametrize("value", [1, "yes", None])
def test_broadcast_buffers_must_be_a_bool(value):
    with pytest.raises(TranspileError, match="broadcast_buffers must be True or False"):
        transpile(M.classify_step, broadcast_buffers=value)


def test_broadcast_buffers_false_drops_the_pass():
    step = transpile(M.classify_step, mode="local_sgd", begin_step=2, broadcast_buffers=False)
    assert all("broadcast_buffers" not in p for p in step.schedule.programs.values())
    # local SGD's warm-up steps are DDP's; its local and sync steps are not
    step = transpile(M.classify_step, mode="local_sgd", begin_step=2)
    assert {name: "broadcast_buffers" in p for name, p in step.schedule.programs.items()} == \
        {"warmup": True, "local": False, "sync": False}


def rank_wrapper_options(given: bool):
    """The model passed in a DDP wrapper made with broadcast_buffers=False and
    an fp16 comm hook: refused unless transpile is given both (then each rank
    equals the same step with the same wrapper in eager); the model untouched
    by the refusal."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", STEPS, BATCH)]
    results = []
    for transpiled in (True, False):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("sgd", model)
        wrapper = _ddp(model, broadcast_buffers=False)
        wrapper.register_comm_hook(None, fp16_compress_hook)
        before = _state(model, opt)
        step = M.classify_step
        if transpiled:
            options = {"broadcast_buffers": False, "comm_hook": (None, fp16_compress_hook)}
            step = transpile(step, mode="fuse_all_reduce", **(options if given else {}))
        try:
            for batch in batches:
                step(wrapper, opt, *batch)
        except TranspileError as e:
            return str(e), M.max_rel_error(_state(model, opt), before)
        results.append(_state(model, opt))
    return M.max_rel_error(*results)


def test_a_ddp_wrapper_with_other_options_is_refused_naming_them(ranks2):
    for message, changed in ranks2.run(rank_wrapper_options, False):
        assert "wrapped in DDP with options its transpiled step was not given" in message
        assert "(broadcast_buffers=False, comm_hook=(state, fp16_compress_hook))" in message
        assert changed == 0.0


def test_a_ddp_wrapper_with_the_options_given_equals_it(ranks2):
    assert ranks2.run(rank_wrapper_options, True) == [0.0, 0.0]


# ------------------------------------------------ averaged at every backward() whose gradients are read

RHO = 0.05


sam = M.sam_step(RHO)


def norm_between_micro_batches(model, opt, x, y):
    """Two micro-batches, the gradient norm of the first returned: the first
    backward()'s gradients are read, so DDP's average of them is what counts."""
    opt.zero_grad()
    (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
    (F.cross_entropy(model(xa), ya) / 2).backward()
    first = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    (F.cross_entropy(model(xb), yb) / 2).backward()
    opt.step()
    return first


def accumulate(model, opt, x, y):
    """Pure accumulation, written as for DDP (no_sync but on the last)."""
    opt.zero_grad()
    for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        with model.no_sync() if isinstance(model, DDP) and i == 0 else contextlib.nullcontext():
            (F.cross_entropy(model(xs), ys) / 2).backward()
    opt.step()


def second_backward(model, opt, x, y):
    """Two losses of one forward, each with its own backward(): DDP averages
    the first one's gradients, and adds the second's as each rank's own."""
    opt.zero_grad()
    out = model(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()
    opt.step()


STEP_FNS = {f.__name__: f for f in (sam, norm_between_micro_batches, accumulate,
                                     second_backward)}


def rank_step_vs_ddp(fn_name, mode, verify=0, find_unused=False):
    """The step transpiled and under DDP with its defaults (no no_sync() but
    where the step says so; find_unused: find_unused_parameters=True for
    both): parameters, optimizer state and .grad after 4 steps, what it
    returned, and the collectives of the program."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = STEP_FNS[fn_name]
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", STEPS, BATCH)]
    results = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=rank if transpiled else 0)
        opt = M.make_optimizer("sgd", model)
        step = transpile(fn, mode=mode, verify=verify, find_unused_parameters=find_unused) \
            if transpiled else fn
        net = model if transpiled else DDP(model, find_unused_parameters=find_unused)
        returned = [step(net, opt, *batch) for batch in batches]
        state = _state(model, opt)
        state.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        results.append((state, [r.detach().clone() for r in returned if r is not None]))
        if transpiled:
            ops = [(n.meta["comm"].op, n.meta["comm"].params) for n in step.program.collectives()]
    return results, ops


@pytest.mark.parametrize("fn_name", ["sam", "norm_between_micro_batches"])
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_read_gradients_averaged_at_their_backward_as_ddp(fn_name, mode, ranks2):
    for ((ours, our_returned), (ddp, ddp_returned)), ops in ranks2.run(rank_step_vs_ddp,
                                                                         fn_name, mode):
        M.assert_states_equal(ours, ddp)
        assert all(torch.equal(a, b) for a, b in zip(our_returned, ddp_returned))
        # two reduction points: each parameter's gradient twice (per parameter,
        # or in one bucket per point)
        params = [p for _, group in ops for p in group]
        assert len(params) == 12 and len(set(params)) == 12
        assert len(ops) == (12 if mode == "grad_allreduce" else 2)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_sam_with_find_unused_parameters_equals_ddp(mode, ranks2):
    # the reductions were ordered by parameter alone, across both points: the
    # first backward()'s came after the second's, after the norm that reads
    # them (the pass failed)
    for ((ours, our_returned), (ddp, ddp_returned)), _ in ranks2.run(
            rank_step_vs_ddp, "sam", mode, 0, True):
        M.assert_states_equal(ours, ddp)
        assert all(torch.equal(a, b) for a, b in zip(our_returned, ddp_returned))


def test_sam_verified_equals_ddp(ranks2):
    """verify= averages its reference where the program does: it accepts."""
    for ((ours, _), (ddp, _)), _ in ranks2.run(rank_step_vs_ddp, "sam", "fuse_all_reduce", STEPS):
        M.assert_states_equal(ours, ddp)


@pytest.mark.parametrize("mode,per_step", [("grad_allreduce", 6), ("fuse_all_reduce", 1)])
def test_pure_accumulation_reduces_once(mode, per_step, ranks2):
    """Micro-batches only accumulated into: one reduction per gradient (bucket),
    equal to DDP under no_sync."""
    for ((ours, _), (ddp, _)), ops in ranks2.run(rank_step_vs_ddp, "accumulate", mode):
        M.assert_states_equal(ours, ddp)
        assert len(ops) == per_step and all(op == "all_reduce" for op, _ in ops)
        assert sorted(p for _, group in ops for p in group) == sorted(
            k.removeprefix("model.") for k in ours if k.startswith("model."))


def rank_refused(mode, fn_name="sam"):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp", seed=0)
    opt = M.make_optimizer("sgd", model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = M.shard(M.batches("mlp", 1, BATCH)[0], rank, world_size)
    with pytest.raises(TranspileError) as info:
        transpile(STEP_FNS[fn_name], mode=mode)(model, opt, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # At most the zero momentum made before the trace is left (issue 27, item 9).
    left = [v for st in opt.state.values() for v in st.values()]
    return str(info.value), all(not v.any() for v in left)


@pytest.mark.parametrize("mode", ["zero", "all_gather"])
def test_modes_that_reduce_once_refuse_sam(mode, ranks2):
    for message, no_update in ranks2.run(rank_refused, mode):
        assert "reads the gradients of backward() number 1 before a later backward()" in message
        assert "use mode 'fuse_all_reduce' or 'grad_allreduce'" in message
        assert no_update


def rank_ddp_grads_agree(fn_name) -> bool:
    """Whether the ranks' gradients agree after the step under DDP."""
    model = DDP(M.make("mlp", seed=0))
    x, y = M.shard(M.batches("mlp", 1, BATCH)[0], dist.get_rank(), dist.get_world_size())
    STEP_FNS[fn_name](model, M.make_optimizer("sgd", model), x, y)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    parts = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grads)
    return all(torch.equal(parts[0], part) for part in parts)


def test_a_second_backward_of_one_forward_is_refused(ranks2):
    # Under DDP the ranks' gradients differ after it (the replicas drift apart);
    # the transpiled step refuses it at the first call, with nothing changed.
    assert ranks2.run(rank_ddp_grads_agree, "second_backward") == [False, False]
    for message, no_update in ranks2.run(rank_refused, "fuse_all_reduce", "second_backward"):
        assert "reaches the parameters of MLP again with no forward through it" in message
        assert "(loss1 + loss2).backward()" in message
        assert no_update


@pytest.mark.parametrize("fn_name", sorted(STEP_FNS))
def test_single_process_equals_eager(fn_name):
    states = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = M.make_optimizer("sgd", model)
        step = transpile(STEP_FNS[fn_name]) if transpiled else STEP_FNS[fn_name]
        for batch in M.batches("mlp", STEPS, BATCH):
            step(model, opt, *batch)
        states.append(_state(model, opt))
    M.assert_states_equal(*states)


def test_early_averages_plan():
    """Which backward() calls the plan averages, from the captured program."""
    from transpiler.program.averaging import early_averages
    from transpiler.capture import flatten_args, trace_step

    model = M.make("mlp", seed=0)
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, BATCH)[0]
    planned = {}
    for name, fn in STEP_FNS.items():
        program = trace_step(fn, flatten_args(fn, (model, opt, x, y), {})).program
        planned[name] = {b: len(nodes) for b, nodes in early_averages(program).items()}
    assert planned == {"sam": {1: 6}, "norm_between_micro_batches": {1: 6}, "accumulate": {},
                       "second_backward": {}}


def rank_ddp_wrapped_given_to_the_step(mode):
    """Code written for DDP: the wrapped model is what the step gets (its
    forward broadcasts buffers; the program does that itself)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", STEPS, BATCH)]
    runs = []
    for transpiled in (True, False):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("sgd", model)
        step = transpile(M.classify_step, mode=mode) if transpiled else M.classify_step
        net = DDP(model)
        for batch in batches:
            step(net, opt, *batch)
        evaluated = M.evaluated(net, batches[0][0] + 1)   # through the wrapper: rank 0's buffers
        runs.append((_state(model, opt), evaluated))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_a_ddp_wrapped_model_with_buffers_given_to_the_step_equals_ddp(mode, ranks2):
    for (ours, evaluated), (ddp, ddp_evaluated) in ranks2.run(
            rank_ddp_wrapped_given_to_the_step, mode):
        M.assert_states_equal(ours, ddp)
        assert torch.equal(evaluated, ddp_evaluated)


def validates_after_its_update(model, opt, x, y, xv, yv):
    """Train, then validate in eval mode inside the step (DDP broadcasts rank
    0's buffers before that second forward through its wrapper)."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        val_loss = F.cross_entropy(model(xv), yv)
    model.train()
    return loss.detach(), val_loss


def rank_validates_after_its_update():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", 3, BATCH)]
    held_out = [M.shard(b, rank, world_size) for b in M.batches("bn", 3, BATCH, seed=7)]
    runs = []
    for transpiled in (True, False):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("sgd", model)
        step = transpile(validates_after_its_update) if transpiled \
            else validates_after_its_update
        net = model if transpiled else DDP(model)
        runs.append([step(net, opt, *b, *v)[1] for b, v in zip(batches, held_out)])
    return runs


@pytest.mark.slow
def test_a_validation_forward_after_the_update_inside_the_step_equals_ddp(ranks2):
    """DDP broadcasts rank 0's buffers before every forward that follows one
    with grad enabled, a second forward inside the step too
    (capture/buffer_sync.py): rank 1 validates with rank 0's BatchNorm
    statistics."""
    for ours, ddp in ranks2.run(rank_validates_after_its_update):
        assert all(torch.equal(a, b) for a, b in zip(ours, ddp))


def with_ema(model, opt, ema, x, y, sync):
    """A step that keeps an EMA of the model (torch's AveragedModel, buffers
    averaged too) beside it and accumulates over calls: the optimizer steps
    on every second call, the calls between run under DDP's no_sync."""
    with model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), y) / 2
        loss.backward()
    if sync:
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model.module if isinstance(model, DDP) else model)
    return loss.detach()


def rank_ema_vs_ddp(mode):
    """BatchNorm model and its EMA, 5 calls (the last one accumulates: DDP
    broadcast before its forward, then each rank updated its own statistics):
    the transpiled step against the same step with the model in DDP (the EMA
    beside it, not wrapped)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", 5, BATCH)]
    states = []
    for transpiled in (True, False):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("sgd", model)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        step = transpile(with_ema, mode=mode) if transpiled else with_ema
        net = model if transpiled else DDP(model)
        for i, batch in enumerate(batches):
            step(net, opt, ema, *batch, i % 2 == 1)
        states.append({**_state(model, opt),
                       **{f"ema.{k}": v.clone() for k, v in ema.state_dict().items()}})
    return states


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_an_ema_beside_the_model_keeps_each_ranks_buffers_as_beside_ddp(mode, ranks2):
    """DDP broadcasts the buffers of the module it wraps, before a forward that
    follows one which synced gradients: not an EMA's (each rank averages its
    own statistics into it), nor after a call under no_sync."""
    results = ranks2.run(rank_ema_vs_ddp, mode)
    for ours, ddp in results:
        M.assert_states_equal(ours, ddp)
    # what the test can tell: the ranks' EMA statistics differ
    assert not torch.equal(results[0][0]["ema.module.bn.running_mean"],
                           results[1][0]["ema.module.bn.running_mean"])
