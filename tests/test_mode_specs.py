"""Typed mode specs (transpiler/mode_specs.py): each mode's options checked where
they are declared, the string form building the same spec, options given to
the wrong mode or twice refused, passes known by their functions; and on two
ranks, a spec trains bit for bit as its string form."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import transpiler
from tests import models as M
from transpiler import (MODES, AllGather, Decentralized, FuseAllReduce, GradAllReduce, LocalSGD,
                        ModeSpec, Pipeline, TranspileError, Zero, transpile)
from passes.average_grads import average_grads
from transpiler.capture import flatten_args, trace_step
from transpiler.mode_specs import SPECS
from transpiler.lowering.context import Mark, PassContext, produces
from transpiler.pipeline import PassError, record, resolve, run_passes

TINY = dict(bucket_mb=2048 / 2**20, first_bucket_mb=256 / 2**20)
STEPS = 5


def test_every_mode_has_a_spec_exported_with_its_passes():
    assert list(SPECS) == list(MODES)
    for name, cls in SPECS.items():
        assert cls.passes is MODES[name]
        assert getattr(transpiler, cls.__name__) is cls and issubclass(cls, ModeSpec)


def test_defaults_are_those_of_the_keywords_before():
    assert dataclasses.asdict(LocalSGD()) == dict(bucket_mb=25.0, first_bucket_mb=1.0,
                                                  fuse_dtype=None, k_steps=4, begin_step=0,
                                                  adaptive=False)
    assert dataclasses.asdict(Decentralized()) == dict(bucket_mb=25.0, first_bucket_mb=1.0,
                                                       topology="ring")
    assert GradAllReduce.options() == ("bucket_mb",)
    assert AllGather.options() == ("bucket_mb", "first_bucket_mb")
    assert Zero.options() == ("bucket_mb", "first_bucket_mb", "fuse_dtype")
    assert FuseAllReduce.options() == Zero.options() + ("comm_hook",)
    with pytest.raises(TypeError):
        LocalSGD(4)   # keywords only: a positional 4 would be a bucket size


@pytest.mark.parametrize("cls,options,message", [
    (LocalSGD, dict(k_steps=0), "k_steps must be an integer >= 1, got 0"),
    (LocalSGD, dict(k_steps=2.5), "k_steps must be an integer >= 1, got 2.5"),
    (LocalSGD, dict(begin_step=-1), "begin_step must be an integer >= 0, got -1"),
    (LocalSGD, dict(adaptive=1), "adaptive must be True or False, got 1"),
    (Zero, dict(bucket_mb=0), "bucket_mb must be a positive number of MiB, got 0"),
    (Zero, dict(bucket_mb=True), "bucket_mb must be a positive number of MiB, got True"),
    (AllGather, dict(first_bucket_mb=-1.0), "first_bucket_mb must be a positive number"),
    (FuseAllReduce, dict(fuse_dtype=torch.int32), "fuse_dtype must be None or one of"),
    (Decentralized, dict(topology="star"), "topology must be one of complete, ring"),
    (Pipeline, dict(passes="average_grads"), "passes must be a list of passes"),
])
def test_a_spec_checks_its_options_where_declared(cls, options, message):
    with pytest.raises(TranspileError, match=message):
        cls(**options)


@pytest.mark.parametrize("name,options,spec", [
    ("local_sgd", dict(k_steps=3, begin_step=2, adaptive=True),
     LocalSGD(k_steps=3, begin_step=2, adaptive=True)),
    ("zero", dict(TINY, fuse_dtype=torch.bfloat16), Zero(**TINY, fuse_dtype=torch.bfloat16)),
    ("decentralized", dict(topology="complete"), Decentralized(topology="complete")),
    ("grad_allreduce", dict(bucket_mb=5), GradAllReduce(bucket_mb=5)),
    ("all_gather", TINY, AllGather(**TINY)),
    ("fuse_all_reduce", dict(k_steps=None, topology=None), FuseAllReduce()),  # None: not given
])
def test_the_string_form_builds_the_same_program_settings_and_schedule(name, options, spec):
    by_name = transpile(M.classify_step, mode=name, **options)
    typed = transpile(M.classify_step, mode=spec)
    assert by_name.settings == typed.settings
    assert vars(by_name.schedule) == vars(typed.schedule)
    assert type(by_name.schedule) is type(typed.schedule)


def test_an_option_of_another_mode_is_refused_naming_who_takes_it():
    with pytest.raises(TranspileError, match=r"^k_steps, adaptive apply only to mode='local_sgd'; "
                                             r"mode='zero' takes bucket_mb, first_bucket_mb, "
                                             r"fuse_dtype$"):
        transpile(M.classify_step, mode="zero", k_steps=4, adaptive=True)
    with pytest.raises(TranspileError, match=r"^fuse_dtype applies only to mode='fuse_all_reduce', "
                                             r"mode='local_sgd', mode='diloco', mode='zero', "
                                             r"mode='fsdp', passes=\[...\]; "
                                             r"mode='grad_allreduce' takes bucket_mb$"):
        transpile(M.classify_step, fuse_dtype=torch.bfloat16)
    with pytest.raises(TranspileError, match=r"^topology applies only to mode='decentralized'; "
                                             r"passes=\[...\] takes bucket_mb, first_bucket_mb, "
                                             r"fuse_dtype$"):
        transpile(M.classify_step, passes=["average_grads", "insert_allreduce"], topology="ring")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        transpile(M.classify_step, mode="zero", bucket_size=4)


def test_an_option_given_in_the_spec_and_as_a_keyword_is_refused():
    with pytest.raises(TranspileError, match=r"k_steps given both in mode=LocalSGD\(...\) and as "
                                             r"keywords of transpile\(\)"):
        transpile(M.classify_step, mode=LocalSGD(k_steps=4), k_steps=2)
    with pytest.raises(TranspileError, match="topology applies only to mode='decentralized'; "
                                             "mode='zero' takes"):
        transpile(M.classify_step, mode=Zero(), topology="ring")
    with pytest.raises(TranspileError, match="give either mode or passes, not both"):
        transpile(M.classify_step, mode=Zero(), passes=["average_grads"])
    with pytest.raises(TranspileError, match=r"unknown mode .*LocalSGD.*; choose one of "
                                             r"grad_allreduce.*\(or its spec: GradAllReduce"):
        transpile(M.classify_step, mode=LocalSGD)   # the class, not a spec


def test_common_options_a_mode_does_not_combine_with_are_refused():
    with pytest.raises(TranspileError, match="verify compares with the eager step"):
        transpile(M.classify_step, mode=LocalSGD(), verify=1)
    with pytest.raises(TranspileError, match="check_every compares the ranks' parameters"):
        transpile(M.classify_step, mode=Decentralized(), check_every=1)
    with pytest.raises(TranspileError, match=r"^mode 'zero' \(shard_optimizer\) does not support "
                                             r"verify yet"):
        transpile(M.classify_step, mode=Zero(), verify=1)


def shard_optimizer(program, ctx):
    """A pass of one's own that happens to share the name of mode zero's pass."""


def test_passes_are_known_by_their_functions_not_their_names():
    zero_passes = list(MODES["zero"])
    by_function = [resolve(p) for p in zero_passes]
    # mode zero's pass given as its function is refused like its name, and shards the state
    with pytest.raises(TranspileError, match=r"mode 'zero' \(shard_optimizer\) does not support "
                                             r"verify"):
        transpile(M.classify_step, passes=by_function, verify=1)
    assert transpile(M.classify_step, passes=by_function)._sharded is not None
    # a pass of one's own with the same __name__ is not mode zero's
    mine = transpile(M.classify_step, passes=["average_grads", "insert_allreduce",
                                              shard_optimizer], verify=1)
    assert mine._sharded is None
    # broadcast_buffers=False drops the pass given by name or as its function
    for passes in (zero_passes, by_function):
        step = transpile(M.classify_step, passes=passes, broadcast_buffers=False)
        assert resolve("broadcast_buffers") not in map(resolve, step.schedule.programs["main"])
        assert len(step.schedule.programs["main"]) == len(zero_passes) - 1


def _program():
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    args = (model, opt, *M.batches("mlp", 1, 4)[0])
    program = trace_step(M.classify_step, flatten_args(M.classify_step, args, {})).program
    record(program, "capture", "capture")
    return program


@produces(Mark.TO_REDUCE)
def my_average(program, ctx):
    """A pass of one's own that marks the gradients to reduce."""
    average_grads(program, ctx)


def test_run_passes_knows_earlier_passes_by_their_functions():
    ctx = PassContext()
    program = _program()
    run_passes(program, [my_average], ctx)
    run_passes(program, ["insert_allreduce"], ctx)   # acts on the marks my_average left
    assert program.applied == ["capture", "my_average", "insert_allreduce"]
    assert [h.fn for h in program.history] == [None, my_average, resolve("insert_allreduce")]

    def average_grads(program, ctx):
        """A pass of one's own, named as the pass that marks gradients; marks nothing."""

    impostor = _program()
    run_passes(impostor, [average_grads], ctx)
    with pytest.raises(PassError, match="pass insert_allreduce acts on the values marked to "
                                        "reduce .*, but no pass before it leaves them"):
        run_passes(impostor, ["insert_allreduce"], ctx)


# ---------------------------------------------------------------- on two ranks

def rank_train(mode, options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode=mode, **options)
    losses = [step(model, opt, *M.shard(batch, rank, world_size))
              for batch in M.batches("mlp", STEPS, 12)]
    return {k: v.clone() for k, v in model.state_dict().items()}, [float(x) for x in losses]


@pytest.mark.parametrize("name,options,spec", [
    ("local_sgd", dict(k_steps=2, begin_step=1), LocalSGD(k_steps=2, begin_step=1)),
    ("zero", TINY, Zero(**TINY)),
])
def test_a_spec_trains_bit_for_bit_as_its_string_form(ranks2, name, options, spec):
    by_name = ranks2.run(rank_train, name, options)
    typed = ranks2.run(rank_train, spec, {})
    for (state, losses), (state_typed, losses_typed) in zip(by_name, typed):
        assert losses == losses_typed
        assert state.keys() == state_typed.keys()
        assert all(torch.equal(state[k], state_typed[k]) for k in state)
    assert any(not torch.equal(typed[0][0][k], M.make("mlp").state_dict()[k])
               for k in typed[0][0])   # it trained
