"""The eager backend's reinplacing: state updated in place, never before the
backward pass and every collective are done."""

import copy

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from tests import models as M
from tests.test_decentralized import ring_context
from tests.test_passes import CTX, _captured
from transpiler import run_passes, transpile

from transpiler.modes import MODES
from transpiler.program.program import InputKind, OutputKind
from transpiler.backends.reinplace import _is_view, _produce_into_slices, reinplace
from transpiler.capture import flatten_args, trace_step
from transpiler.program.roles import DECISION, Role


PROGRAMS = [(mode, name, passes) for mode, programs in sorted(MODES.items())
            for name, passes in (programs.items() if isinstance(programs, dict)
                                 else [("main", programs)])]


@pytest.mark.parametrize("mode,name,passes", PROGRAMS, ids=[f"{m}-{n}" for m, n, _ in PROGRAMS])
def test_state_is_written_only_after_gradients_and_communication(mode, name, passes):
    program = _captured("tied").program
    run_passes(program, passes, ring_context(CTX) if mode == "decentralized" else CTX)
    gm, written = reinplace(program)
    nodes = list(gm.graph.nodes)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    last = max(i for i, n in enumerate(nodes)
               if n.op == "call_function" and n.meta["role"] & (Role.BACKWARD | Role.COMM))
    mutations = [i for i, n in enumerate(nodes) if _mutates(n)
                 and any(_base(a) in placeholders for a in torch.utils._pytree.tree_leaves(n.args[:1]))]
    if mode == "diloco" and name != "local":
        # The pseudo-gradients' sums read the updated parameters: the updates
        # are written back by the runtime once every collective is done.
        assert not mutations
        return
    assert mutations, "the optimizer's updates should run in place"
    assert min(mutations) > last
    if mode == "zero":
        # The all-gathers read the updated shards, so the last collective ends
        # after the update: the state shards are written back by the runtime,
        # and each parameter straight from its gathered rows.
        in_place = {spec.target: w for w, spec in zip(written, program.outputs)
                    if spec.kind is OutputKind.UPDATE}
        kinds = {spec.name: spec.kind for spec in program.inputs}
        assert in_place and all(w == (kinds[t] is InputKind.PARAM) for t, w in in_place.items())
        return
    # Every state update was done in place: no write-back copies remain. In
    # local SGD's sync program the optimizer's update feeds the collective, so
    # only the averaged parameters, computed in their snapshots, are in place.
    kinds = {spec.name: spec.kind for spec in program.inputs}
    in_place = {spec.target: w for w, spec in zip(written, program.outputs) if spec.kind is OutputKind.UPDATE}
    if name == "sync":
        in_place = {t: w for t, w in in_place.items() if kinds[t] is InputKind.HELD}
        assert len(in_place) == len(program.grads)
    assert all(in_place.values())


def _base(node):
    """The tensor a chain of views reads."""
    while node.op == "call_function" and _is_view(node.target):
        node = node.args[0]
    return node


def _mutates(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def test_functional_program_is_left_functional():
    program = _captured().program
    before = program.listing()
    reinplace(program)
    assert program.listing() == before


def test_error_inside_the_program_leaves_state_untouched():
    model = M.make("tied")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.lm_step)
    tokens, targets = M.batches("tied", 1, 4)[0]
    for _ in range(2):  # steady state: the in-place program
        step(model, opt, tokens, targets)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    bad = tokens.clone()
    bad[0, 0] = 1000  # out of the embedding's range: fails in the forward pass
    with pytest.raises(IndexError):
        step(model, opt, bad, targets)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, after[p][k]) for p, st in before[1]["state"].items() for k, v in st.items())


def _packed_gradients(model_name):
    """fuse_all_reduce's executable graph on `model_name`, its nodes and the
    buckets it all-reduces."""
    program = _captured(model_name).program
    run_passes(program, MODES["fuse_all_reduce"], CTX)
    nodes = list(reinplace(program)[0].graph.nodes)
    buckets = {n.args[0] for n in nodes if n.target is torch.ops._c10d_functional.all_reduce_.default}
    return program, nodes, buckets


def _offset_bytes(view: fx.Node) -> int:
    """Where a view of a bucket's slice starts in the bucket, in bytes."""
    while view.target is not torch.ops.aten.slice.Tensor:
        view = view.args[0]
    return view.args[2] * view.meta["val"].element_size()


def test_matmul_and_sum_gradients_are_computed_into_their_bucket():
    program, nodes, buckets = _packed_gradients("mlp")
    into = [n for n in nodes if n.target in (torch.ops.aten.mm.out, torch.ops.aten.sum.IntList_out)]
    copied = [n for n in nodes if n.target is torch.ops.aten.copy_.default]
    # Every gradient of an MLP is a weight's matmul or a bias's sum: each one
    # whose slice of its bucket starts 64 bytes apart from the bucket's start
    # (aligned as a new tensor, where the kernel rounds as into one) writes it,
    # the others are copied there.
    assert into and len(into) + len(copied) == len(program.grads) == 6
    assert all(_base(n.kwargs["out"]) in buckets for n in into)
    assert all(_offset_bytes(n.kwargs["out"]) % 64 == 0 for n in into)
    assert all(_offset_bytes(n.args[0]) % 64 for n in copied)
    # Each bucket is allocated before the first op that writes into it.
    position = {n: i for i, n in enumerate(nodes)}
    assert all(position[_base(n.kwargs["out"])] < position[n] for n in into)


def test_a_tied_weight_gradient_is_summed_in_its_bucket():
    # The tied embedding's gradient is the output layer's matmul plus the
    # embedding's backward, added in place into the matmul's result: the
    # matmul writes into the bucket and the addition is done there.
    _, nodes, buckets = _packed_gradients("tied")
    assert not [n for n in nodes if n.target is torch.ops.aten.copy_.default]
    added = [n for n in nodes if n.target is torch.ops.aten.add_.Tensor]
    assert len(added) == 1 and added[0].args[0].target is torch.ops.aten.mm.out
    assert _base(added[0].args[0].kwargs["out"]) in buckets


def _pack(case: str):
    """A gradient of a matmul copied into its bucket's slice, as the eager
    lowering leaves it, where `case` is "alone" (or "alone_like_a_view": the
    bucket is allocated like a view of it; "added_before": something is added
    to the gradient in place before the copy), "added_after" (... after it),
    "also_read" (something else reads the gradient), "bucket_written" (the
    bucket is written between the matmul and the copy) or "unaligned" (its
    slice starts 4 bytes into the bucket, where mm rounds otherwise)."""
    start = 1 if case == "unaligned" else 16   # 64 bytes: aligned as a new tensor
    end, size = start + 91, start + 91 + 16

    def pack(a, b, c):
        if case == "bucket_written":
            bucket = torch.ops.aten.new_empty.default(a, [size], dtype=torch.float32)
        g = torch.mm(a, b)
        if case == "bucket_written":
            bucket[:].fill_(3.0)
        else:   # allocated after the matmul, like its gradient or a view of it
            like = g.view(-1) if case == "alone_like_a_view" else g
            bucket = torch.ops.aten.new_empty.default(like, [size], dtype=torch.float32)
        other = g * c if case == "also_read" else c
        if case == "added_before":
            g.add_(c)
        bucket[start:end].copy_((like if case == "alone_like_a_view" else g).reshape(-1))
        if case == "added_after":
            g.add_(c)
        bucket[:start].fill_(1.0)
        bucket[end:].fill_(2.0)
        return bucket, other
    gm = make_fx(pack, tracing_mode="fake")(*_pack_inputs())
    for node in gm.graph.nodes:   # later uses read the tensor an op updated, as reinplace writes them
        if node.target is torch.ops.aten.add_.Tensor:
            node.replace_all_uses_with(node.args[0], delete_user_cb=lambda u: u is not node)
    return gm


def _pack_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, 1000, generator=g), torch.randn(1000, 13, generator=g),
            torch.randn(7, 13, generator=g)]


@pytest.mark.parametrize("case", ["alone", "alone_like_a_view", "added_before", "added_after",
                                  "also_read", "bucket_written", "unaligned"])
def test_a_gradient_is_computed_into_its_slice_only_when_nothing_else_uses_it(case):
    gm = _pack(case)
    inputs = _pack_inputs()
    expected = gm(*inputs)
    _produce_into_slices(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    alone = case in ("alone", "alone_like_a_view", "added_before")
    assert (torch.ops.aten.mm.out in targets) is alone
    assert (torch.ops.aten.copy_.default in targets) is not alone
    assert all(torch.equal(x, y) for x, y in zip(gm(*inputs), expected))


class _StridedWrite(torch.nn.Module):
    """Writes every other column of a fresh buffer (a slice_scatter with a
    step, which the eager program writes in place)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        buffer = torch.zeros(x.shape[0], 16)
        buffer[:, ::2] = self.lin(x).tanh()
        buffer[:, 1:9:3] = 1.5
        return buffer.square().mean()


def _strided_step(model, opt, x, y):
    opt.zero_grad()
    loss = model(x)
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_strided_slice_of_a_fresh_buffer_is_written_in_place_with_its_step():
    M.against_eager(_strided_step, build=_StridedWrite)


class _SpectralSum(torch.nn.Module):
    """A view_as_real of an FFT, added to and then left, while the FFT itself
    is read afterwards: the add may not be written into the view."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(9, 2))
        self.head = torch.nn.Linear(9, 1)

    def forward(self, x):
        spectrum = torch.fft.rfft(x)
        shifted = torch.view_as_real(spectrum) + self.w
        return self.head(shifted.sum(-1) + spectrum.abs()).square().mean()


def test_a_view_that_is_no_view_op_by_name_is_not_written_in_place():
    """view_as_real shares its complex tensor's storage, as its schema says;
    written in place, the spectrum read after it changed from the second call
    on."""
    M.against_eager(_strided_step, build=_SpectralSum)


def test_a_decision_is_checked_before_the_first_collective():
    """A decision on a tensor value that reads neither the backward pass nor a
    collective stays where the trace put it: sunk after them with the rest of
    such nodes, a rank whose decision changed would issue the collectives of
    the program it leaves, and its peers' of the next one would not match."""
    from tests.test_decisions import Branchy, step
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    captured = trace_step(step, flatten_args(step, (model, opt, x), {}))
    program = captured.program
    run_passes(program, MODES["fuse_all_reduce"], CTX)
    nodes = list(reinplace(program)[0].graph.nodes)
    checks = [i for i, n in enumerate(nodes) if DECISION in n.meta]
    issued = [i for i, n in enumerate(nodes) if n.meta.get("role", Role.FORWARD) & Role.COMM]
    assert checks and issued and max(checks) < min(issued)
