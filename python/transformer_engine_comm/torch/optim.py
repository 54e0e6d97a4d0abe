"""``torch.optim.Adam(fused=True)`` with a host-lean step (:class:`LeanFusedAdam`).

torch's fused Adam runs one multi-tensor kernel per step, but its ``step()`` costs about
200 µs of host time inside a training step (bench/RESULTS.md, 2026-11-26, sixth session):
a profiler range, the hook chains, the per-parameter state walk that rebuilds six lists,
the regrouping of those lists by device and dtype, and the functional dispatch. At the
tensor-parallel per-rank shapes, where a step's GPU time is a few milliseconds, that is a
tenth of the step's host time, and the host is what the GPU waits for once overlap has
hidden the communication.

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
sparse or complex tensor, a parameter group added or a group's parameter list changed, a
parameter not on CUDA, a CUDA-graph capture in progress (torch's step checks ``capturable``).
The prepared lists hold the state's tensors: ``load_state_dict`` drops them; state tensors
replaced by hand in ``optimizer.state`` are not seen (rebuild with ``optimizer._lean_plans =
None``).
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


class _GroupPlan:
    """One parameter group's lists for the fused kernel, per (device, dtype) as torch
    groups them: (params, grads-to-be, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)."""

    __slots__ = ("params_obj", "params", "parts")

    def __init__(self, params_obj, params: List[torch.Tensor], parts):
        self.params_obj = params_obj
        self.params = params
        self.parts = parts  # [(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)]


class LeanFusedAdam(Adam):
    """``torch.optim.Adam(params, ..., fused=True)`` with a host-lean ``step()`` and
    ``zero_grad()`` (see the module docstring). Takes Adam's arguments; ``fused`` is always
    True (``foreach`` must not be set)."""

    def __init__(self, params, lr=1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 capturable: bool = False, decoupled_weight_decay: bool = False):
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                  capturable=capturable, fused=True)
        if decoupled_weight_decay:
            kw["decoupled_weight_decay"] = True
        super().__init__(params, **kw)
        self._lean_plans: Optional[List[_GroupPlan]] = None

    def _lean_ready(self) -> Optional[List[_GroupPlan]]:
        """The prepared lists, (re)built when the groups changed; None where the lean step
        cannot run this time (see the module docstring)."""
        plans = self._lean_plans
        groups = self.param_groups
        if plans is not None and len(plans) == len(groups):
            for plan, g in zip(plans, groups):
                if plan.params_obj is not g["params"] or len(plan.params) != len(g["params"]):
                    plans = None
                    break
            if plans is not None:
                return plans
        plans = []
        state = self.state
        for g in groups:
            if g.get("differentiable", False) or not g.get("fused", False) or torch.is_tensor(g["lr"]):
                return None
            by_key = {}
            for p in g["params"]:
                st = state.get(p)
                if not st or "step" not in st or not p.is_cuda or p.is_sparse or torch.is_complex(p):
                    return None
                if g["amsgrad"] and "max_exp_avg_sq" not in st:
                    return None
                lists = by_key.setdefault((p.device, p.dtype), ([], [], [], [], []))
                lists[0].append(p)
                lists[1].append(st["exp_avg"])
                lists[2].append(st["exp_avg_sq"])
                if g["amsgrad"]:
                    lists[3].append(st["max_exp_avg_sq"])
                lists[4].append(st["step"])
            plans.append(_GroupPlan(g["params"], list(g["params"]), list(by_key.values())))
        self._lean_plans = plans
        return plans

    def step(self, closure=None):
        """One Adam step: the lean path where it applies, else torch's own."""
        if (closure is not None or _profiling() or _compiling() or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _torch_optimizer._global_optimizer_pre_hooks
                or _torch_optimizer._global_optimizer_post_hooks
                or getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None):
            return _TORCH_STEP(self, closure)
        plans = self._lean_ready()  # (CUDA parameters only)
        if plans is None or torch.cuda.is_current_stream_capturing():
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
        super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients to None directly (``set_to_none=True``, the profiler off); else
        torch's own."""
        if not set_to_none or _profiling():
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
