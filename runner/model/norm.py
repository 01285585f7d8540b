"""The project's RMSNorm on CUDA (KernelChoices.norm_shrink, csrc/sgmv.cu `rms_norm` / `norm_shrink`).

It computes what runner/model/ops.py `rms_norm` / `add_rms_norm` compute, rounding for rounding (the residual sum
rounded to the model's dtype; normalised in fp32; Llama: cast, then times w; Gemma: times (1 + w) in fp32, then
cast), writing the new residual to a separate tensor instead of in place. It exists so that one launch can do more
than the norm: with FP8 weights it also quantizes the rows for the projection that follows (bit for bit
quantize_tokens of its output), and in decode steps with adapters it also computes that projection group's LoRA
shrink (runner/lora/step.py LoraStepImpl.norm_shrink), which otherwise is a launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NormOperands:
    """One norm's inputs and its residual output: x = norm(h + res) and res_out = h + res (res None: x = norm(h))."""

    h: torch.Tensor  # [T, H]
    res: torch.Tensor | None  # [T, H]
    res_out: torch.Tensor | None  # [T, H], with res; never one of the inputs
    w: torch.Tensor  # [H]
    eps: float
    offset: float  # 0: Llama's norm; 1: Gemma's (1 + w)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


class OwnNorm:
    """The standalone launch, for norms whose launch does not also shrink (no adapter in the step, or a step whose
    LoRA takes other kernels)."""

    def __init__(self, ext, eps: float, offset: float):
        self.ext, self.eps, self.offset = ext, float(eps), float(offset)

    @staticmethod
    def applies(h: torch.Tensor, w: torch.Tensor) -> bool:
        return (h.is_cuda and h.dim() == 2 and h.dtype in (torch.bfloat16, torch.float16) and h.is_contiguous()
                and h.shape[1] % 8 == 0 and w.dtype == h.dtype and w.is_contiguous() and w.numel() == h.shape[1]
                and h.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)

    def operands(self, h: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor,
                 res_out: torch.Tensor | None = None) -> NormOperands:
        """`res_out`: where the new residual goes (a fresh tensor when None)."""
        if res is not None and (res_out is None or res_out.shape != res.shape or not res_out.is_contiguous()
                                or res_out.data_ptr() % 16 or _overlap(res_out, res) or _overlap(res_out, h)):
            res_out = torch.empty_like(res)
        return NormOperands(h, res.contiguous() if res is not None else None, res_out if res is not None else None,
                            w, self.eps, self.offset)

    def run(self, x_out: torch.Tensor, n: NormOperands,
            quant: tuple[torch.Tensor, torch.Tensor] | None = None, early: bool = False) -> None:
        """`early` (as with `quant`): the next kernel may start at once, its weight streaming beside this launch; only
        where every kernel that may follow waits for this one before it reads x_out (the wgmma products) or is
        launched without programmatic dependent launch (KernelChoices.norm_early)."""
        q_out, q_scale = quant if quant is not None else (None, None)
        self.ext.rms_norm(x_out, n.h, n.res, n.res_out, n.w, n.eps, n.offset, q_out, q_scale, True,
                          torch.cuda.current_stream(x_out.device).cuda_stream, **({"early": True} if early else {}))
