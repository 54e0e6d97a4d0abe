"""``torch.optim.Adam(fused=True)`` with a host-lean step (:class:`LeanFusedAdam`).

torch's fused Adam runs one multi-tensor kernel per step, but its ``step()`` and
``zero_grad()`` cost about 360 µs of host time inside a training step of LayerNormMLP's six
parameters, against about 130 µs here (bench/RESULTS.md, 2026-11-26, sixth session). In
``step()``: a profiler range, the hook chains, the per-parameter state walk that rebuilds
six lists, the regrouping of those lists by device and dtype, and the functional dispatch.
At the tensor-parallel per-rank shapes, where a step's GPU time is a few milliseconds, that
is about a fifth of the step's host time, and the host is what the GPU waits for once
overlap has hidden the communication.

:class:`LeanFusedAdam` is ``torch.optim.Adam`` (a subclass: the same parameter groups,
hyperparameters, state and ``state_dict``) whose ``step()`` makes the same two calls torch's
fused path makes, ``torch._foreach_add_(steps, 1)`` and ``torch._fused_adam_`` (or
``_fused_adamw_``), on lists prepared once, with the group's hyperparameters read at every
step (learning-rate schedulers work). The results are bit-identical to
``torch.optim.Adam(fused=True)``'s (same kernels, same arguments). ``zero_grad()`` with
``set_to_none=True`` sets the gradients to None directly.

Whenever the lean path's preconditions do not hold, the step is torch's own (``Adam.step``
with its hooks and profiler range): a closure, a registered step hook (global or the
optimizer's), the profiler on, ``torch.compile`` tracing, a GradScaler's ``grad_scale`` /
``found_inf``, a tensor learning rate, ``differentiable``, a parameter without its
gradient or its state (the first step initialises the state through torch's path), a
sparse or complex tensor, a parameter not on CUDA, a CUDA-graph capture in progress (torch's
step checks ``capturable``). The prepared lists are checked at every step against the
parameter groups (the same list objects holding the same parameters) and the state (the
same ``optimizer.state``, each parameter with the same state dict), and rebuilt when one
changed (a group added, a parameter swapped in, the state cleared or loaded). Tensors
replaced by hand inside a parameter's state dict are not seen (rebuild with
``optimizer._lean_plans = None``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.optim import Adam
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import Optimizer

__all__ = ["LeanFusedAdam"]

# torch's own step with its hooks and profiler range, wrapped once here. Adam.step is torch's
# step under its grad-mode decorator, and after the first Adam's construction also under
# the hook wrapper (marked `hooked`): only that outer wrapper is taken off (the decorator's
# own __wrapped__ is the step without its grad mode).
_RAW_ADAM_STEP = Adam.step.__wrapped__ if getattr(Adam.step, "hooked", False) else Adam.step
_TORCH_STEP = Optimizer.profile_hook_step(_RAW_ADAM_STEP)


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _lean_device(p: torch.Tensor) -> bool:
    # The lean path's devices (CUDA; a function, so that a CPU-only test can widen it).
    return p.is_cuda


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class _GroupPlan:
    """One parameter group's lists for the fused kernel, per (device, dtype) as torch
    groups them: (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps); and what they
    were made from (the group's parameter list object, its parameters, each one's state
    dict), checked at every step."""

    __slots__ = ("params_obj", "params", "states", "parts")

    def __init__(self, params_obj, params: List[torch.Tensor], states: List[dict], parts):
        self.params_obj = params_obj
        self.params = params
        self.states = states
        self.parts = parts  # [(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)]

    def current(self, group, state) -> bool:
        """Whether the lists still describe `group` and the optimizer's `state`: the same
        list object holding the same parameters, each with the same state dict."""
        ps = group["params"]
        if ps is not self.params_obj or len(ps) != len(self.params):
            return False
        for p, q, st in zip(ps, self.params, self.states):
            if p is not q or state.get(p) is not st:
                return False
        return True


class LeanFusedAdam(Adam):
    """``torch.optim.Adam(params, ..., fused=True)`` with a host-lean ``step()`` and
    ``zero_grad()`` (see the module docstring). Takes Adam's arguments; ``fused`` is always
    True (``fused=False`` and ``foreach=True`` are refused)."""

    def __init__(self, params, lr=1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False):
        # Adam's signature, so that Adam(..., fused=True) can be swapped for this class.
        if fused is False or foreach:
            raise ValueError("LeanFusedAdam is the fused Adam: fused=False / foreach=True are torch.optim.Adam's")
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                  capturable=capturable, differentiable=differentiable, fused=True)
        if decoupled_weight_decay:
            kw["decoupled_weight_decay"] = True
        super().__init__(params, **kw)
        self._lean_plans: Optional[List[_GroupPlan]] = None
        self._lean_failed = None

    def __setstate__(self, state) -> None:
        # (copy.deepcopy, pickling: torch keeps only defaults, state and param_groups)
        super().__setstate__(state)
        self._lean_plans = None
        self._lean_failed = None

    def _lean_ready(self) -> Optional[List[_GroupPlan]]:
        """The prepared lists, (re)built when the groups or the state changed; None where
        the lean step cannot run this time (see the module docstring)."""
        groups = self.param_groups
        state = self.state
        for g in groups:  # read at every step: they may be set after the lists were made
            if g.get("differentiable", False) or not g.get("fused", False) or torch.is_tensor(g["lr"]):
                return None
        plans = getattr(self, "_lean_plans", None)
        if plans is not None and len(plans) == len(groups) and all(
                plan.current(g, state) for plan, g in zip(plans, groups)):
            return plans
        self._lean_plans = None
        # A failed build is not retried until the state or the groups change (a parameter
        # that never gets a gradient keeps every step on torch's path, at torch's cost).
        mark = (id(state), len(state), len(groups), sum(len(g["params"]) for g in groups))
        if getattr(self, "_lean_failed", None) == mark:
            return None
        plans = []
        for g in groups:
            by_key = {}
            states = []
            for p in g["params"]:
                st = state.get(p)
                if (not st or "step" not in st or not _lean_device(p) or p.is_sparse or torch.is_complex(p)
                        or (g["amsgrad"] and "max_exp_avg_sq" not in st)):
                    self._lean_failed = mark
                    return None
                states.append(st)
                lists = by_key.setdefault((p.device, p.dtype), ([], [], [], [], []))
                lists[0].append(p)
                lists[1].append(st["exp_avg"])
                lists[2].append(st["exp_avg_sq"])
                if g["amsgrad"]:
                    lists[3].append(st["max_exp_avg_sq"])
                lists[4].append(st["step"])
            plans.append(_GroupPlan(g["params"], list(g["params"]), states, list(by_key.values())))
        self._lean_plans = plans
        self._lean_failed = None
        return plans

    def step(self, closure=None):
        """One Adam step: the lean path where it applies, else torch's own."""
        if (closure is not None or _profiling() or _compiling() or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _torch_optimizer._global_optimizer_pre_hooks
                or _torch_optimizer._global_optimizer_post_hooks
                or getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None):
            return _TORCH_STEP(self, closure)
        plans = self._lean_ready()  # (CUDA parameters only)
        if plans is None or _capturing():
            return _TORCH_STEP(self, closure)
        # Every parameter needs its gradient (torch's path skips those without one).
        for plan in plans:
            for p in plan.params:
                g = p.grad
                if g is None or g.is_sparse:
                    return _TORCH_STEP(self, closure)
        for plan, group in zip(plans, self.param_groups):
            if group["amsgrad"] and any(not part[3] for part in plan.parts):
                return _TORCH_STEP(self, closure)  # amsgrad turned on after the lists were made
        for plan, group in zip(plans, self.param_groups):
            beta1, beta2 = group["betas"]
            fn = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
            for params, exp_avgs, exp_avg_sqs, max_sqs, steps in plan.parts:
                torch._foreach_add_(steps, 1)
                fn(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, max_sqs, steps,
                   amsgrad=group["amsgrad"], lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                   grad_scale=None, found_inf=None)
        return None

    # Not wrapped by torch's profile_hook_step: this step calls torch's wrapped one itself
    # where hooks or the profiler need it.
    step.hooked = True

    def load_state_dict(self, state_dict) -> None:
        # New state tensors: the prepared lists are rebuilt at the next step.
        self._lean_plans = None
        self._lean_failed = None
        super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients to None directly (``set_to_none=True``, the profiler off); else
        torch's own."""
        if not set_to_none or _profiling():
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
