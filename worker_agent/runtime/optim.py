"""AdamW over one flat `[params | exp_avg | exp_avg_sq]` buffer.

Hand-written (same arithmetic as torch.optim.AdamW's single-tensor path) because the optimizer
state must live in the worker's flat buffer with the parameters' exact shard geometry; being
elementwise, the update of an element does not depend on how the state is sharded.
"""

from __future__ import annotations

import math

import torch

from worker_agent.runtime.presets import OptimizerSpec


def adamw_step(flat: torch.Tensor, grad: torch.Tensor, step: int, opt: OptimizerSpec) -> None:
    """Apply AdamW step number `step` (1-based) in place; `grad` has the parameters' size."""
    n = grad.numel()
    if flat.numel() != 3 * n:
        raise ValueError(f"flat buffer has {flat.numel()} elements, expected 3 x {n}")
    with torch.no_grad():
        param, m, v = flat[:n], flat[n : 2 * n], flat[2 * n :]
        if opt.weight_decay:
            param.mul_(1 - opt.lr * opt.weight_decay)
        m.lerp_(grad, 1 - opt.beta1)
        v.mul_(opt.beta2).addcmul_(grad, grad, value=1 - opt.beta2)
        bias_correction1 = 1 - opt.beta1**step
        bias_correction2_sqrt = math.sqrt(1 - opt.beta2**step)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(opt.eps)
        param.addcdiv_(m, denom, value=-opt.lr / bias_correction1)
