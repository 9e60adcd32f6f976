"""Golden listings of each pass on a tiny model, the plan functions, and the
pass pipeline's checks. No process group needed: passes only edit graphs."""

import dataclasses
import logging
import os
import pathlib

import pytest
import torch

from passes.insert_allreduce import plan_allreduce
from passes.ring_round_robin import plan_rings
from transpiler.program.mesh import Dim, Mesh
from tests import models as M
from transpiler import PassContext, PassError, Role, run_passes
from transpiler.capture import flatten_args, trace_step
from transpiler.modes import MODES, STARTUP_PASSES
from transpiler.pipeline import record
from transpiler.program.program import Held, Hyper, InputKind, new_node
from transpiler.runtime.startup import startup_program

GOLDEN = pathlib.Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
CTX = PassContext(mesh=Mesh(2, 0, 2, {Dim.WORLD: ("ring0", "ring1")}), nrings=2)


def _captured(model_name="tiny", optimizer="sgd"):
    torch.manual_seed(0)
    model = M.MLP([4, 8, 3]) if model_name == "tiny" else M.make(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd" \
        else torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    fn = M.step_fn("tied" if model_name == "tied" else "mlp")
    batch = M.shard(M.batches(model_name if model_name == "tied" else "mlp", 1, 4)[0], 0, 1)
    if model_name == "tiny":
        batch = (batch[0][:, :4], batch[1] % 3)
    fn(model, opt, *batch)  # create the momentum buffers: capture the steady-state step
    captured = trace_step(fn, flatten_args(fn, (model, opt, *batch), {}))
    record(captured.program, "capture", "capture")
    return captured


def _check_golden(name: str, text: str):
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"no golden listing {path}; run with UPDATE_GOLDEN=1"
    assert text + "\n" == path.read_text(), f"{name} differs from {path} (UPDATE_GOLDEN=1 updates)"


MAIN = MODES["grad_allreduce"]


@pytest.mark.parametrize("upto", range(len(MAIN) + 1))
def test_golden_main(upto):
    program = _captured().program
    run_passes(program, MAIN[:upto], CTX)
    name = MAIN[upto - 1] if upto else "capture"
    _check_golden(f"main_{upto}_{name}", str(program))


@pytest.mark.parametrize("upto", range(1, len(STARTUP_PASSES) + 1))
def test_golden_startup(upto):
    startup = startup_program(_captured())
    run_passes(startup, STARTUP_PASSES[:upto], CTX)
    _check_golden(f"startup_{upto}_{STARTUP_PASSES[upto - 1]}", str(startup))


SYNC = MODES["local_sgd"]["sync"]


@pytest.mark.parametrize("upto", [SYNC.index("local_sgd") + 1, len(SYNC)])
def test_golden_local_sgd_sync(upto):
    program = _captured().program.copy("sync")
    run_passes(program, SYNC[:upto], dataclasses.replace(CTX, adaptive_k=True))
    _check_golden(f"sync_{upto}_{SYNC[upto - 1]}", str(program))


def test_golden_startup_with_snapshots():
    captured = _captured()
    local = captured.program.copy("local")
    run_passes(local, MODES["local_sgd"]["local"], CTX)
    startup = startup_program(captured, [s for s in local.inputs if s.kind is InputKind.HELD])
    run_passes(startup, STARTUP_PASSES, CTX)
    _check_golden("startup_snapshots", str(startup))


def test_copy_is_independent():
    program = _captured().program
    before = program.listing()
    copy = program.copy("sync")
    run_passes(copy, SYNC, CTX)
    assert program.listing() == before and program.applied == ["capture"]
    assert copy.name == "sync" and len(copy.inputs) > len(program.inputs)


def test_listing_is_deterministic():
    assert str(_captured().program) == str(_captured().program)


def test_history_has_a_listing_per_pass_when_debugging(caplog):
    program = _captured().program
    run_passes(program, MAIN, CTX)
    assert program.applied == ["capture", *MAIN]
    assert program.history[-1].listing is None   # off the default path
    with caplog.at_level(logging.DEBUG, logger="transpiler"):
        program = _captured().program
        run_passes(program, MAIN, CTX)
    assert program.history[-1].listing == program.listing()
    assert "insert_allreduce: " in program.history[1 + MAIN.index("insert_allreduce")].provenance


def test_passes_do_not_apply_on_one_rank():
    program = _captured().program
    before = program.listing()
    run_passes(program, MAIN, PassContext())
    assert program.listing() == before


def test_every_node_has_a_role_and_the_seed_is_unique():
    program = _captured("tied").program
    roles = [n.meta["role"] for n in program.graph.nodes if n.op == "call_function"]
    assert roles.count(Role.BACKWARD | Role.LOSS) == 1
    assert {Role.FORWARD, Role.BACKWARD, Role.OPTIMIZE} <= set(roles)


def test_tied_unused_and_frozen_parameters():
    program = _captured("tied").program
    # embed.weight and out.weight are one tensor with one gradient; unused and
    # frozen parameters have none.
    assert sorted(program.grads) == ["embed.weight", "hidden.bias", "hidden.weight"]
    assert [s.name for s in program.state_of("embed.weight")] == ["embed.weight:momentum_buffer"]
    assert program.state_of("unused") == []  # never stepped: no state
    assert plan_allreduce(program) == []  # nothing is marked to reduce before average_grads
    averaged = MAIN.index("average_grads") + 1
    run_passes(program, MAIN[:averaged], CTX)   # broadcast_buffers (none), ..., average_grads
    assert [g.meta["param"] for g in plan_allreduce(program)] == list(program.grads)
    run_passes(program, MAIN[averaged:], CTX)
    assert len(program.collectives()) == 3


def test_plan_rings():
    assert plan_rings(5, 2) == [0, 1, 0, 1, 0]
    assert plan_rings(3, 1) == [0, 0, 0]
    assert plan_rings(0, 4) == []
    assert plan_rings(2, 4) == [0, 1]
    with pytest.raises(ValueError):
        plan_rings(3, 0)


def test_ring_round_robin_sets_group_and_meta():
    program = _captured().program
    run_passes(program, MAIN, CTX)
    for i, node in enumerate(program.collectives()):
        assert node.meta["comm"].ring == i % 2
        assert node.args[-1] == CTX.mesh.ring(Dim.WORLD, i)


def test_requirement_error_names_pass_and_requirement():
    program = _captured().program
    with pytest.raises(PassError, match="pass insert_allreduce acts on the values marked to "
                                        "reduce.*but no pass before it leaves them"):
        run_passes(program, ["insert_allreduce"], CTX)
    with pytest.raises(PassError, match="ring_round_robin requires insert_allreduce or"):
        run_passes(program, ["ring_round_robin"], CTX)
    with pytest.raises(PassError, match="pass local_sgd requires snapshot_params"):
        run_passes(program, ["local_sgd"], CTX)


def test_unknown_pass():
    with pytest.raises(PassError, match="unknown pass 'no_such_pass'.*insert_allreduce"):
        run_passes(_captured().program, ["no_such_pass"], CTX)


def test_failing_pass_is_named_with_the_passes_before():
    def broken(program, ctx):
        raise RuntimeError("boom")

    program = _captured().program
    with pytest.raises(PassError, match=r"pass broken failed .*after capture, average_grads.*boom"):
        run_passes(program, ["average_grads", broken], CTX)


def test_node_without_role_is_rejected():
    def roleless(program, ctx):
        seed = next(n for n in program.graph.nodes if n.meta.get("role") == Role.BACKWARD | Role.LOSS)
        with program.graph.inserting_after(seed):
            node = new_node(program.graph, torch.ops.aten.neg.default, (seed,), Role.BACKWARD)
        del node.meta["role"]

    with pytest.raises(PassError, match="nodes without a role: neg"):
        run_passes(_captured().program, [roleless], CTX)


def dropout_then_rand(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(torch.nn.functional.dropout(model(x), 0.5), y)
    (loss * torch.rand(())).backward()
    opt.step()


def test_pass_that_reorders_random_ops_is_rejected():
    """Random ops draw in eager's order: a pass that moves one before another
    (here rand, which reads nothing, before dropout's bernoulli) is an error."""
    def reorders(program, ctx):
        bernoulli, rand = [n for n in program.graph.nodes if n.target in (
            torch.ops.aten.bernoulli.p, torch.ops.aten.rand.default)]
        bernoulli.prepend(rand)

    torch.manual_seed(0)
    model = M.MLP([4, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (model, opt, torch.randn(2, 4), torch.tensor([0, 2]))
    program = trace_step(dropout_then_rand, flatten_args(dropout_then_rand, args, {})).program
    run_passes(program, ["average_grads"], CTX)   # a pass that keeps them passes
    with pytest.raises(PassError, match=r"pass reorders failed .*changed the program's random "
                                        r"ops or their order \(bernoulli, rand -> rand, "
                                        r"bernoulli\)"):
        run_passes(program, [reorders], CTX)


def test_inputs_say_what_they_hold_in_typed_fields():
    program = _captured().program
    hypers = [spec.hyper for spec in program.inputs if spec.kind is InputKind.HYPER]
    assert Hyper("lr", group=0, optimizer=0) in hypers
    run_passes(program, ["snapshot_params"], CTX)
    held = {spec.param: spec.held for spec in program.inputs if spec.kind is InputKind.HELD}
    assert held == {name: Held.SNAPSHOT for name in program.grads}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero", "all_gather", "decentralized",
                                  "grad_allreduce"])
def test_values_of_new_nodes_are_those_of_fake_dispatch(mode, optimizer):
    """new_node computes values with meta kernels, not fake-tensor dispatch: the
    shape, strides, offset, dtype and device of every node a pass made (and
    functionalization: the optimizer's out-of-place foreach ops) are what fake
    dispatch gives."""
    from tests.test_decentralized import ring_context
    from tests.test_fuse_all_reduce import SMALL
    program = _captured("tied", optimizer).program
    run_passes(program, MODES[mode], ring_context(SMALL) if mode == "decentralized" else SMALL)
    checked = sum(_check_like_fake_dispatch(node) for node in program.graph.nodes)
    assert checked > 50


def test_foreach_values_are_those_of_fake_dispatch_for_any_layout():
    """new_node's shortcut for elementwise foreach ops (contiguous operands of
    one shape and one floating dtype, or 0-d) and its fallback for the rest:
    transposed, broadcast, mixed-dtype, integer and scalar-list operands."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    aten = torch.ops.aten
    with FakeTensorMode():
        a = [torch.empty(3, 4), torch.empty(4, 3).t(), torch.empty(5)]
        b = [torch.empty(3, 4), torch.empty(3, 4), torch.empty(5)]
        wide = [torch.empty(3, 4), torch.empty(2, 3, 4), torch.empty(1)]
        half = [torch.empty(3, 4, dtype=torch.float16)] * 3
        ints = [torch.zeros(3, 4, dtype=torch.int64)] * 3
        zero_d = torch.empty(())
        double = torch.empty((), dtype=torch.float64)
    graph = torch.fx.Graph()

    def placeholder(value):
        if isinstance(value, list) and isinstance(value[0], torch.Tensor):
            return [placeholder(v) for v in value]
        if not isinstance(value, torch.Tensor):
            return value
        node = graph.placeholder(f"x{len(graph.nodes)}")
        node.meta["val"] = value
        return node

    calls = [
        (aten._foreach_mul.List, (a, b)), (aten._foreach_mul.List, (b, b)),
        (aten._foreach_add.List, (b, wide)), (aten._foreach_mul.Tensor, (b, zero_d)),
        (aten._foreach_mul.Tensor, (b, double)), (aten._foreach_mul.List, (half, half)),
        (aten._foreach_div.Scalar, (ints, 2)), (aten._foreach_sqrt.default, (a,)),
        (aten._foreach_lerp.Scalar, (b, b, 0.5)), (aten._foreach_addcdiv.ScalarList, (b, b, b, [1., 2, 3])),
        (aten._foreach_pow.ScalarAndTensor, (0.9, [zero_d] * 3)),
        (aten._foreach_add.List, ([zero_d] * 3, [double] * 3)),
    ]
    for target, args in calls:
        node = new_node(graph, target, tuple(placeholder(x) for x in args), Role.OPTIMIZE)
        assert _check_like_fake_dispatch(node) == 3, target


def _check_like_fake_dispatch(node) -> int:
    """How many tensors node's value holds, each checked against fake dispatch."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with _fake_mode(vals):
        expected = node.target(*vals[0], **vals[1])
    ours = torch.utils._pytree.tree_leaves(node.meta["val"])
    expected = torch.utils._pytree.tree_leaves(expected)
    assert len(ours) == len(expected), node.name
    for a, b in zip(ours, expected):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype, a.device) == \
            (b.shape, b.stride(), b.storage_offset(), b.dtype, b.device), node.name
    return len(ours)


def _fake_mode(vals):
    return next(v.fake_mode for v in torch.utils._pytree.tree_leaves(vals)
                if hasattr(v, "fake_mode"))
