"""The optimizer updates a program computes, with every hyperparameter a tensor.

torch's SGD, Adam and AdamW branch on their hyperparameters in Python and hand
them to kernels as Python numbers (`alpha=weight_decay`), which a trace bakes
into the program. While a step is captured, the arithmetic of their step() (the
functional sgd()/adam() it calls once per parameter group, after torch has
gathered the gradients and created the state) is done by the updates below
instead: the foreach ops of torch's capturable path, in its order, with each
value read from a 0-d tensor input of the program. Changing a value (lr,
momentum, dampening, weight decay, betas, eps) never traces or compiles again.

Which terms exist is the program's structure: weight decay and momentum on or
off, and the flags (nesterov, maximize, amsgrad, ...). A term that is off
costs nothing; switching one on traces again, once, and says why.

The values torch derives in Python (1 - beta1, 1 - dampening, 1 - lr * weight
decay) are derived here on the host in double precision, so they round as
eager's do, and where torch fuses a scalar into a kernel (`add(g, p, alpha=wd)`,
one rounding) the program uses addcmul by the 0-d tensor, which rounds once too.

A group traced for backend eager reads its values as Python numbers instead
(`as_numbers`: each 0-d input's .item(), traced as a symbolic number) where
the arithmetic above is not eager's: a bfloat16 or float16 parameter, whose
kernels round a 0-d tensor operand to the tensor's dtype (0.1 becomes
0.10009765625 in bfloat16) where a Python number is kept in float32, and
whose `add` rounds its Python scalar to the tensor's dtype; and a parameter
off the CPU, whose kernels group their operands otherwise (CUDA's addcdiv is
self + value * (t1 / t2), the CPU's self + value * t1 / t2); and a capturable
group, whose single-tensor update computes otherwise than the multi-tensor
one. Only torch's own calls with Python numbers round as eager's there. Its
update is then torch's single- or multi-tensor code with the terms fixed
(`_sgd_update_numbers`, `_adam_update_numbers`), each foreach op once per
device and dtype as torch groups them; the inputs are float64, so .item()
gives the double eager passes, and nothing traces again when a value changes.

A fused group (Adam and AdamW with fused=True) traced for backend eager runs
torch's fused kernel itself (`_adam_fused`), which reads lr from its float64
host tensor as eager's double; the kernel takes the other values as numbers
that a program holds as constants, so they stay in the signature (a change
traces again: Formulation.keys_lifted). SGD's fused kernel cannot be traced
(no fake implementation): SGD(fused=True) is refused there.

Adam's bias corrections are computed as torch's default (neither capturable
nor fused) Adam computes them: on the host, in double precision, from each
parameter's step count as this call's update makes it (the count is state the
program increments; the host reads it before each call, as torch's
_get_value(step) does), and fed as one value per parameter of the group (a
checkpoint may hold different counts in one group). A capturable or fused
optimizer keeps its count on the device: its update is torch's capturable
formulation, which computes them there (reading the count on the host would
synchronize).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import struct
from typing import Callable

import torch
from torch._subclasses.fake_tensor import disable_fake_tensor_cache
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_scalar_dtype

from ..errors import TranspileError

# How each lifted value is derived from a param group, on the host.
_DERIVE: dict[str, Callable[[dict], float]] = {
    "lr": lambda g: g["lr"],
    "momentum": lambda g: g["momentum"],
    "one_minus_dampening": lambda g: 1 - g["dampening"],
    "weight_decay": lambda g: g["weight_decay"],
    "beta1": lambda g: g["betas"][0],
    "beta2": lambda g: g["betas"][1],
    "one_minus_beta1": lambda g: 1 - g["betas"][0],
    "one_minus_beta2": lambda g: 1 - g["betas"][1],
    "eps": lambda g: g["eps"],
    "one_minus_lr_weight_decay": lambda g: 1 - g["lr"] * g["weight_decay"],
}

# Values derived per parameter from the group and the step count its update
# reaches, in torch's default Adam's expressions (_single_tensor_adam and
# _multi_tensor_adam agree: -(lr / bc1) is (lr / bc1) * -1, and every op casts
# the double to the tensor's dtype). The program reads them as one vector per
# group, an entry per parameter of the group.
_PER_STEP: dict[str, Callable[[dict, float], float]] = {
    "neg_step_size": lambda g, step: -(g["lr"] / (1 - g["betas"][0] ** step)),
    "bias_correction2_sqrt": lambda g, step: (1 - g["betas"][1] ** step) ** 0.5,
}
PER_STEP = frozenset(_PER_STEP)


def hyper_value(optimizer: torch.optim.Optimizer, group_index: int, name: str,
                ahead: int = 0) -> float | list[float]:
    """The value of a lifted hyperparameter for this call: a number, or for a
    per-step value a list with an entry per parameter of the group, for the
    update `ahead` updates after this call's first."""
    group = optimizer.param_groups[group_index]
    if name in _DERIVE:
        return float(_DERIVE[name](group))
    return per_step_value(group, step_counts(optimizer, group_index), name, ahead)


StepCount = tuple  # (the count as a number or None, the dtype of its tensor or None)


def step_counts(optimizer: torch.optim.Optimizer, group_index: int) -> list[StepCount]:
    """Each parameter's step count in a group, as the optimizer holds it now."""
    counts = []
    for p in optimizer.param_groups[group_index]["params"]:
        count = optimizer.state.get(p, {}).get("step")
        counts.append((count.item(), count.dtype) if isinstance(count, torch.Tensor)
                      else (count, None))
    return counts


def per_step_value(group: dict, counts: list[StepCount], name: str, ahead: int) -> list[float]:
    """A value derived from the step count (PER_STEP), an entry per parameter
    of the group whose counts are `counts`, for the update `ahead` updates
    after the first that starts from them."""
    derive, steps = _PER_STEP[name], {}
    for key in counts:
        if key not in steps:
            count = key[0]
            for _ in range(ahead + 1):
                count = _next_step(count, key[1])
            steps[key] = derive(group, count)
    return [steps[key] for key in counts]


def _next_step(count: float | None, dtype: torch.dtype | None) -> float:
    """The step count after the update's increment (`step_t += 1`, in the
    count's dtype), as a Python float. No count yet: the first step (a
    parameter the program does not update has no state; its entry is unused)."""
    if count is None:
        return 1.0
    after = float(count) + 1
    if dtype == torch.float32:   # the float32 sum, rounded to nearest even
        after = struct.unpack("f", struct.pack("f", after))[0]
    return after


@dataclasses.dataclass(frozen=True)
class Formulation:
    """An optimizer's update, with its hyperparameters as inputs.

    group_keys: the param-group entries whose values are lifted (they leave the
    signature; terms() stands for them there). terms(group): the terms that are
    on, in a fixed order. lifted(terms): the values the update reads.
    functionals: (module, name) of the functions step() calls per group.
    update(group, h, terms, params, grads, *state lists): the update, h the
    lifted values as 0-d tensors; update_on_numbers: the same, h as Python
    numbers (reads_numbers); update_fused: torch's fused kernel, for a fused
    group that reads numbers.
    initial_state(group, p): the state torch's first step creates for p, made
    now, when starting the update from it gives the first step's results
    exactly; None when it does not (SGD's dampening: torch's first step takes
    the undamped gradient as its momentum buffer)."""

    group_keys: tuple[str, ...]
    terms: Callable[[dict], tuple[str, ...]]
    lifted: Callable[[tuple[str, ...]], tuple[str, ...]]
    functionals: tuple[tuple[str, str], ...]
    update: Callable
    update_on_numbers: Callable   # the same with Python numbers (reads_numbers)
    initial_state: Callable[[dict, torch.Tensor], dict | None]
    # torch's fused kernel, for a fused group read as numbers; None: refused
    update_fused: Callable | None = None

    def keys_lifted(self, group: dict) -> tuple[str, ...]:
        """The group's entries that leave the signature: group_keys, or lr
        alone for a fused group, whose kernel takes the others as constants."""
        return ("lr",) if group.get("fused") else self.group_keys


def _nonzero(group: dict, keys) -> tuple[str, ...]:
    return tuple(k for k in keys if group[k] != 0)


# ------------------------------------------------------------ SGD

def _sgd_terms(group):
    return _nonzero(group, ("weight_decay", "momentum")) + (
        ("foreach",) if _eager_foreach(group) else ())


def _sgd_lifted(terms):
    # 1 - dampening is read whenever momentum is on: a multiply-add by 1.0 is an
    # exact add, so dampening never changes the program's structure.
    values = tuple(t for t in terms if t in ("weight_decay", "momentum"))
    return ("lr",) + values + (("one_minus_dampening",) if "momentum" in terms else ())


def _sgd_update(group, h, terms, params, grads, momentum_buffer_list):
    """torch.optim.sgd._multi_tensor_sgd, its traced (compiling) branch."""
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    if "weight_decay" in terms:
        grads = _add_scaled(grads, params, h["weight_decay"])
    if "momentum" in terms:
        momentum, undamped = h["momentum"], h["one_minus_dampening"]
        bufs = momentum_buffer_list
        if all(b is not None for b in bufs):
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_addcmul_(bufs, grads, [undamped] * len(bufs))
        else:
            for i, (buf, grad) in enumerate(zip(bufs, grads)):
                if buf is None:
                    bufs[i] = grad.detach().clone()
                else:
                    buf.mul_(momentum).addcmul_(grad, undamped)
        if group["nesterov"]:
            grads = _add_scaled(grads, bufs, momentum)
        else:
            grads = bufs
    torch._foreach_addcmul_(params, grads, [-h["lr"]] * len(params))


def _sgd_initial_state(group, p):
    """torch's first step with momentum copies the gradient into the buffer;
    0 * momentum + 1 * gradient, what the update computes from zeros, is the
    same value (dampening 0, where 1 - dampening is 1)."""
    if group["momentum"] == 0:
        return {}
    if group["dampening"] != 0:
        return None
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _sgd_update_numbers(group, h, terms, params, grads, momentum_buffer_list):
    """torch.optim.sgd's update with Python numbers, line for line, on the path
    eager takes (_eager_foreach): _multi_tensor_sgd (nesterov then writes into
    the gradients) or _single_tensor_sgd."""
    maximize, nesterov = group["maximize"], group["nesterov"]
    lr = h["lr"]
    wd = h["weight_decay"] if "weight_decay" in terms else None
    momentum = h["momentum"] if "momentum" in terms else None
    undamped = h.get("one_minus_dampening")
    if "foreach" not in terms:
        for i, param in enumerate(params):
            grad = grads[i] if not maximize else -grads[i]
            if wd is not None:
                grad = grad.add(param, alpha=wd)
            if momentum is not None:
                buf = momentum_buffer_list[i]
                if buf is None:
                    buf = momentum_buffer_list[i] = grad.detach().clone()
                else:
                    buf.mul_(momentum).add_(grad, alpha=undamped)
                grad = grad.add(buf, alpha=momentum) if nesterov else buf
            param.add_(grad, alpha=-lr)
        return
    for members in _by_device_and_dtype(params):
        # Without momentum, torch's SGD gathers no buffers at all (an empty list).
        bufs = [momentum_buffer_list[i] for i in members] if momentum is not None else None
        _sgd_foreach_numbers(maximize, nesterov, lr, wd, momentum, undamped,
                             [params[i] for i in members], [grads[i] for i in members], bufs)
        for i, buf in zip(members, bufs or ()):
            momentum_buffer_list[i] = buf


def _sgd_foreach_numbers(maximize, nesterov, lr, wd, momentum, undamped, params, grads, bufs):
    """_multi_tensor_sgd's update of one group of tensors of a device and dtype;
    a buffer it creates is set in `bufs`."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if wd is not None:
        if maximize:
            torch._foreach_add_(grads, params, alpha=wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    if momentum is not None:
        if all(b is not None for b in bufs):
            _foreach_mul_number_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=undamped)
        else:
            for i, (buf, grad) in enumerate(zip(bufs, grads)):
                if buf is None:
                    bufs[i] = grad.detach().clone()
                else:
                    buf.mul_(momentum).add_(grad, alpha=undamped)
        if nesterov:
            torch._foreach_add_(grads, bufs, alpha=momentum)
        else:
            grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)


def _by_device_and_dtype(params) -> list[list[int]]:
    """The positions of the parameters of each device and dtype, as torch's
    multi-tensor updates group them (_group_tensors_by_device_and_dtype): each
    foreach op runs once per group, and on a list of mixed dtypes it takes
    another kernel (on CUDA, one op per tensor) that rounds otherwise."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    return list(groups.values())


def _foreach_mul_number_(xs, number) -> None:
    """torch._foreach_mul_(xs, number) as eager computes it: on CPU, in place,
    a bfloat16 or float16 tensor is multiplied by the number rounded to its
    dtype (the out-of-place op, which the program may run instead, keeps it in
    float32; the rounded factor gives both the in-place result)."""
    rounded = {}
    for x in xs:
        if x.dtype in _REDUCED and x.device.type == "cpu" and x.dtype not in rounded:
            rounded[x.dtype] = torch.full((), number, dtype=torch.float32).to(x.dtype)
    plain = [x for x in xs if x.dtype not in rounded]
    if plain:
        torch._foreach_mul_(plain, number)
    for dtype, factor in rounded.items():
        torch.ops.aten._foreach_mul_.Tensor([x for x in xs if x.dtype == dtype], factor)


def _eager_foreach(group: dict) -> bool:
    """Whether eager's step takes torch's multi-tensor path for the group (its
    `foreach`, by default where torch's foreach kernels run): a term of a
    group that reads numbers, whose update follows that path (their roundings
    differ: an in-place foreach op is a loop of in-place ops)."""
    if not _needs_numbers(group) or group.get("fused"):
        return False
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    return _default_to_fused_or_foreach(group["params"], group.get("differentiable", False))[1]


def _add_scaled(xs, ys, scale):
    """xs + ys * scale, rounded once like torch's add(xs, ys, alpha=scale):
    addcmul by a 0-d tensor is one fused multiply-add (as are the in-place
    addcmul_ above), a mul then an add is two roundings."""
    return torch._foreach_addcmul(xs, ys, [scale] * len(xs))


# ------------------------------------------------------------ Adam, AdamW

def _adam_terms(group):
    """The weight decay that is on, and where the bias corrections are computed:
    in the program for a capturable or fused optimizer (its step count lives on
    the device), else on the host."""
    terms = ()
    if group["weight_decay"] != 0:
        terms += ("decoupled_weight_decay" if group.get("decoupled_weight_decay")
                  else "weight_decay",)
    if group.get("capturable") or group.get("fused"):
        terms += ("capturable",) + (("fused",) if group.get("fused") else ())
    if _eager_foreach(group):
        terms += ("foreach",)
    return terms


def _adam_lifted(terms):
    # lr is read by the capturable update, and by adaptive local SGD.
    lifted = ("lr", "beta2", "one_minus_beta1", "one_minus_beta2", "eps")
    lifted += ("beta1",) if "capturable" in terms else ("neg_step_size", "bias_correction2_sqrt")
    if "weight_decay" in terms:
        lifted += ("weight_decay",)
    if "decoupled_weight_decay" in terms:
        lifted += ("one_minus_lr_weight_decay",)
    return lifted


def _adam_update(group, h, terms, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                 state_steps):
    """torch.optim.adam._multi_tensor_adam: the bias corrections of its default
    branch, from the host (_PER_STEP), or those of its capturable branch."""
    n = len(params)
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(state_steps, 1)
    if "decoupled_weight_decay" in terms:
        torch._foreach_mul_(params, h["one_minus_lr_weight_decay"])
    if "weight_decay" in terms:
        grads = _add_scaled(grads, params, h["weight_decay"])
    torch._foreach_lerp_(exp_avgs, grads, [h["one_minus_beta1"]] * n)
    torch._foreach_mul_(exp_avg_sqs, h["beta2"])
    torch._foreach_addcmul_(exp_avg_sqs, torch._foreach_mul(grads, h["one_minus_beta2"]), grads)

    if group["amsgrad"]:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        exp_avg_sq_sqrt = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
    if "capturable" in terms:
        _capturable_step(h, params, exp_avgs, exp_avg_sq_sqrt, state_steps)
    else:
        _default_step(group, h, params, exp_avgs, exp_avg_sq_sqrt)


def _adam_update_numbers(group, h, terms, params, grads, exp_avgs, exp_avg_sqs,
                         max_exp_avg_sqs, state_steps):
    """torch.optim.adam's update (not fused) with Python numbers, line for
    line, on the path eager takes (_eager_foreach): _multi_tensor_adam or
    _single_tensor_adam, each with its default bias corrections (from the
    host, _PER_STEP) or its capturable ones (from the step counts on the
    device)."""
    maximize, amsgrad = group["maximize"], group["amsgrad"]
    capturable = "capturable" in terms
    at = _positions(group, params)
    bc2_sqrt = None if capturable else [h["bias_correction2_sqrt"][i] for i in at]
    neg_step_size = None if capturable else [h["neg_step_size"][i] for i in at]
    if "foreach" not in terms:
        for i, param in enumerate(params):
            grad = grads[i] if not maximize else -grads[i]
            exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
            state_steps[i] += 1
            if "decoupled_weight_decay" in terms:
                param.mul_(h["one_minus_lr_weight_decay"])
            elif "weight_decay" in terms:
                grad = grad.add(param, alpha=h["weight_decay"])
            exp_avg.lerp_(grad, h["one_minus_beta1"])
            exp_avg_sq.mul_(h["beta2"]).addcmul_(grad, grad, value=h["one_minus_beta2"])
            if capturable:
                step = state_steps[i]
                step_size_neg = (h["lr"] / (1 - h["beta1"] ** step)).neg()
                bias_correction2_sqrt = (1 - h["beta2"] ** step).sqrt()
                if amsgrad:
                    max_exp_avg_sqs[i].copy_(torch.maximum(max_exp_avg_sqs[i], exp_avg_sq))
                    exp_avg_sq = max_exp_avg_sqs[i]
                denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(
                    h["eps"] / step_size_neg)
                param.addcdiv_(exp_avg, denom)
                continue
            if amsgrad:
                torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
                exp_avg_sq = max_exp_avg_sqs[i]
            denom = (exp_avg_sq.sqrt() / bc2_sqrt[i]).add_(h["eps"])
            param.addcdiv_(exp_avg, denom, value=neg_step_size[i])
        return
    for members in _by_device_and_dtype(params):
        def part(xs):
            return None if xs is None else [xs[i] for i in members]
        _adam_foreach_numbers(group, h, terms, part(params), part(grads), part(exp_avgs),
                              part(exp_avg_sqs), part(max_exp_avg_sqs) if amsgrad else None,
                              part(state_steps), part(bc2_sqrt), part(neg_step_size))


def _adam_foreach_numbers(group, h, terms, params, grads, exp_avgs, exp_avg_sqs,
                          max_exp_avg_sqs, state_steps, bc2_sqrt, neg_step_size):
    """_multi_tensor_adam's update of one group of tensors of a device and
    dtype."""
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(state_steps, 1)
    if "decoupled_weight_decay" in terms:
        _foreach_mul_number_(params, h["one_minus_lr_weight_decay"])
    if "weight_decay" in terms:
        if group["maximize"]:
            torch._foreach_add_(grads, params, alpha=h["weight_decay"])
        else:
            grads = torch._foreach_add(grads, params, alpha=h["weight_decay"])
    torch._foreach_lerp_(exp_avgs, grads, h["one_minus_beta1"])
    _foreach_mul_number_(exp_avg_sqs, h["beta2"])
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, h["one_minus_beta2"])
    if "capturable" in terms:
        neg_step_size, bc2_sqrt = _capturable_corrections(h, state_steps, lambda v: v)
    if max_exp_avg_sqs is not None:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        exp_avg_sq_sqrt = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(exp_avg_sq_sqrt, bc2_sqrt)
    torch._foreach_add_(exp_avg_sq_sqrt, h["eps"])
    if "capturable" in terms:
        torch._foreach_div_(exp_avg_sq_sqrt, neg_step_size)
        torch._foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt)
    else:
        torch._foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt, neg_step_size)


def _adam_fused(group, h, terms, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                state_steps):
    """torch.optim.adam._fused_adam: torch's fused kernel, per device and dtype,
    lr its 0-d float64 host tensor (which the kernel reads as the double
    eager passes), the other values constants of the program
    (Formulation.keys_lifted). A GradScaler unscales the gradients before it
    (scaler.traced_scalers), by a power of two: as exact as the kernel's own
    unscaling."""
    kernel = torch.ops.aten._fused_adamw_.tensor_lr if group.get("decoupled_weight_decay") \
        else torch.ops.aten._fused_adam_.tensor_lr
    beta1, beta2 = group["betas"]
    for members in _by_device_and_dtype(params):
        steps = [state_steps[i] for i in members]
        torch._foreach_add_(steps, 1)
        kernel([params[i] for i in members], [grads[i] for i in members],
               [exp_avgs[i] for i in members], [exp_avg_sqs[i] for i in members],
               [max_exp_avg_sqs[i] for i in members] if group["amsgrad"] else [], steps,
               amsgrad=group["amsgrad"], lr=h["lr"], beta1=beta1, beta2=beta2,
               weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def _positions(group, params) -> list[int]:
    """Where each parameter the update gets (those with a gradient) is in the
    group (while traced, the group lists the traced parameters)."""
    position = {id(p): i for i, p in enumerate(group["params"])}
    return [position[id(p)] for p in params]


def _default_step(group, h, params, exp_avgs, exp_avg_sq_sqrt):
    """denom = sqrt / bias_correction2_sqrt + eps; param.addcdiv_(exp_avg,
    denom, value=-step_size), with each parameter's own values. The CPU kernel
    of addcdiv computes param + (value * exp_avg) / denom in the tensor's
    dtype: the multiply by the 0-d value first rounds the same."""
    at = _positions(group, params)
    neg_step_size, bias_correction2_sqrt = (torch.unbind(h[k]) for k in
                                            ("neg_step_size", "bias_correction2_sqrt"))
    torch._foreach_div_(exp_avg_sq_sqrt, [bias_correction2_sqrt[i] for i in at])
    # A Python-level _foreach_add_(list, tensor) would take the tensor for a
    # Scalar and read its value: name the Tensor overload.
    torch.ops.aten._foreach_add_.Tensor(exp_avg_sq_sqrt, h["eps"])
    torch._foreach_addcdiv_(params, torch._foreach_mul(exp_avgs, [neg_step_size[i] for i in at]),
                            exp_avg_sq_sqrt)


def _capturable_corrections(h, state_steps, base):
    """_multi_tensor_adam's capturable bias corrections from the step counts:
    -lr / (1 - beta1^t) and sqrt(1 - beta2^t). `base(value)` is beta1's and
    beta2's form as _foreach_pow's first operand (a number, or a 0-d tensor
    per step count)."""
    bias_correction1 = torch._foreach_pow(base(h["beta1"]), state_steps)
    bias_correction2 = torch._foreach_pow(base(h["beta2"]), state_steps)
    torch._foreach_sub_(bias_correction1, 1)
    torch._foreach_sub_(bias_correction2, 1)
    torch._foreach_neg_(bias_correction2)
    torch._foreach_div_(bias_correction1, h["lr"])
    torch._foreach_reciprocal_(bias_correction1)
    torch._foreach_sqrt_(bias_correction2)
    return bias_correction1, bias_correction2


def _capturable_step(h, params, exp_avgs, exp_avg_sq_sqrt, state_steps):
    """The bias corrections of _multi_tensor_adam's capturable branch, from the
    step counts in the program."""
    step_size, bias_correction2_sqrt = _capturable_corrections(
        h, state_steps, lambda v: [v] * len(params))
    torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
    torch.ops.aten._foreach_add_.Tensor(exp_avg_sq_sqrt, h["eps"])
    torch._foreach_div_(exp_avg_sq_sqrt, step_size)
    torch._foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt)


def _adam_initial_state(group, p):
    """Adam._init_group's lazy state: the update then runs from these zeros,
    as torch's first step does."""
    on_device = group.get("capturable") or group.get("fused")
    state = {
        "step": (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                             device=p.device) if on_device
                 else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


_SGD = Formulation(("lr", "momentum", "dampening", "weight_decay"), _sgd_terms, _sgd_lifted,
                   (("torch.optim.sgd", "sgd"),), _sgd_update, _sgd_update_numbers,
                   _sgd_initial_state)
_ADAM = Formulation(("lr", "betas", "eps", "weight_decay"), _adam_terms, _adam_lifted,
                    (("torch.optim.adam", "adam"), ("torch.optim.adamw", "adamw")), _adam_update,
                    _adam_update_numbers, _adam_initial_state, _adam_fused)
_REDUCED = (torch.bfloat16, torch.float16)


# Whether the programs being traced run as eager's ops (backend eager): a
# compiler (inductor) decomposes lerp by a branch on its weight, which a number
# read in the program cannot take; it reads 0-d tensors, within its tolerance.
_NUMBERS = [True]


@contextlib.contextmanager
def numbers_where_needed(enabled: bool):
    """While a step is traced: whether its groups that need them
    (_needs_numbers) read their hyperparameters as numbers (exact as eager,
    for backend eager)."""
    before = _NUMBERS[0]
    _NUMBERS[0] = enabled
    try:
        yield
    finally:
        _NUMBERS[0] = before


def _needs_numbers(group: dict) -> bool:
    """Whether only Python numbers give the group eager's roundings: a
    bfloat16 or float16 parameter, one off the CPU, torch's fused kernel,
    which reads them as numbers, or its capturable update, whose single-tensor
    form differs from the multi-tensor one (module docstring)."""
    return bool(group.get("fused") or group.get("capturable")) or any(
        p.dtype in _REDUCED or p.device.type != "cpu" for p in group["params"])


def reads_numbers(group: dict) -> bool:
    """Whether a group's update reads its hyperparameters as Python numbers:
    one that needs them (_needs_numbers), traced for backend eager."""
    return _NUMBERS[0] and _needs_numbers(group)


def as_numbers(h: dict[str, torch.Tensor]) -> dict:
    """The lifted values as the symbolic numbers the trace reads from them: a
    number, or a list of them for a per-parameter vector."""
    return {k: v.item() if v.dim() == 0 else [x.item() for x in v.unbind()]
            for k, v in h.items()}
FORMULATIONS: dict[type, Formulation] = {
    torch.optim.SGD: _SGD, torch.optim.Adam: _ADAM, torch.optim.AdamW: _ADAM,
}


def formulation_of(opt: torch.optim.Optimizer) -> Formulation | None:
    """The optimizer's formulation, or None where its step is traced as torch
    wrote it (another optimizer type, a hyperparameter that is not a Python
    number, complex parameters): then every hyperparameter is part of the
    signature and a change traces again."""
    form = FORMULATIONS.get(type(opt))
    if form is None:
        return None
    for group in opt.param_groups:
        values = [group.get(k) for k in form.group_keys]
        values = [v for value in values for v in (value if isinstance(value, tuple) else (value,))]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return None
        if any(p.is_complex() for p in group["params"]):
            return None
    return form


@contextlib.contextmanager
def updates_with_lifted_hyperparameters(groups: dict[int, tuple],
                                        later: Callable[[dict, str, int], torch.Tensor]):
    """While tracing, route the functional updates of the groups in `groups`
    (id of a traced parameter -> (formulation, group, terms, {name: tensor},
    numbers), optimizer_state.formulated_groups) to the formulations. Groups
    of other optimizers take torch's own path. A group updated again in the
    same call (a critic stepped several times) reads its values derived from
    the step count from later(group, name, k), the input of its k-th update
    after the first."""
    patched = []
    updates: dict[int, int] = {}   # id of a group -> its updates so far in the trace

    def route(original):
        def functional(params, grads, *lists, **kwargs):
            target = groups.get(id(params[0])) if params else None
            if target is None:
                return original(params, grads, *lists, **kwargs)
            form, group, terms, h, numbers = target
            ahead = updates[id(group)] = updates.get(id(group), -1) + 1
            if ahead:
                h = {k: later(group, k, ahead) if k in PER_STEP else v for k, v in h.items()}
            update = form.update
            if numbers and "fused" in terms:   # (refuse_fused_without_kernel)
                update = form.update_fused
            elif numbers:
                update, h = form.update_on_numbers, as_numbers(h)
            if kwargs.get("has_sparse_grad") or kwargs.get("grad_scale") is not None \
                    or kwargs.get("found_inf") is not None:
                raise TranspileError(
                    "sparse gradients and GradScaler's grad_scale/found_inf cannot be captured "
                    "in a program's optimizer update; use dense gradients and unscale outside "
                    "the optimizer")
            fake_mode = getattr(params[0], "fake_mode", None)
            # Each foreach op of the update lists every parameter: fake tensors'
            # cache would hash them all and never hit.
            with disable_fake_tensor_cache(fake_mode) if fake_mode else contextlib.nullcontext():
                update(group, h, terms, params, grads, *lists)
        return functional

    modules = {m for form in set(FORMULATIONS.values()) for m in form.functionals}
    try:
        for module_name, name in sorted(modules):
            module = importlib.import_module(module_name)
            original = getattr(module, name, None)
            if original is not None:
                patched.append((module, name, original))
                setattr(module, name, route(original))
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
