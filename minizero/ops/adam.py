"""`deepspeed.ops.adam.DeepSpeedCPUAdam` and `FusedAdam` with DeepSpeed's arguments, as torch's
Adam.

DeepSpeed builds both from C++/CUDA sources; torch's Adam has a fused kernel on CUDA and CPU
(`fused=True`), which these use, so a script that names them runs without a build. adamw_mode /
adam_w_mode True (DeepSpeed's default) is AdamW's decoupled weight decay. bias_correction=False and
amsgrad=True are refused (DeepSpeed's kernels refuse amsgrad too); fp32_optimizer_states and
set_grad_none are accepted at their defaults. Each class takes its own defaults back
(minizero.initialize rebuilds the optimizer over ZeRO's shards from the class and its defaults).
"""
from __future__ import annotations

import torch


class _Adam(torch.optim.Adam):
    def _build(self, params, lr, bias_correction, betas, eps, weight_decay, amsgrad, decoupled,
               who):
        if not bias_correction:
            raise ValueError(f"{who}: bias_correction=False is not implemented (torch's Adam "
                             "always corrects)")
        if amsgrad:
            raise ValueError(f"{who}: amsgrad=True is not supported, as in DeepSpeed")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         # torch's fused kernel, CPU and CUDA
                         decoupled_weight_decay=decoupled, fused=True)


class DeepSpeedCPUAdam(_Adam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        self._build(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                    adamw_mode, "DeepSpeedCPUAdam")
        # DeepSpeed's names, so the class rebuilds itself
        for group in [self.defaults, *self.param_groups]:
            group.update(adamw_mode=adamw_mode, bias_correction=bias_correction)


class FusedAdam(_Adam):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0., amsgrad=False, set_grad_none=True):
        self._build(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode,
                    "FusedAdam")
        for group in [self.defaults, *self.param_groups]:
            group.update(adam_w_mode=adam_w_mode, bias_correction=bias_correction)
