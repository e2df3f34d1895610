"""`Muon` on `fully_shard`-ed parameters: torch.optim.Muon's updates, each Newton-Schulz run once in the world.

torch 2.13's `torch.optim.Muon` step, for a matrix parameter W with gradient G and momentum buffer B:

    B <- lerp(B, G, 1 - momentum)                       (elementwise: runs on each rank's piece)
    U <- lerp(G, B, momentum) if nesterov else B        (elementwise)
    O <- NewtonSchulz(U)                                (the whole matrix: runs on its owner)
    W <- W * (1 - lr * weight_decay) - adjusted_lr * O  (elementwise)

Newton-Schulz starts by casting U to bfloat16 and returns bfloat16, so pieces travel in bfloat16
both ways: half the bytes of fp32, and the same numbers the unsharded optimizer computes.
"""

from __future__ import annotations

import math

import torch

from .whole_matrix import WholeMatrixOptimizer, local

# Keller Jordan's quintic coefficients and step count, torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of `matrix`, in bfloat16.

    `matrix` is [M, N], or [E, M, N] for a stack of E matrices orthogonalized one by one (each
    normalized by its own norm). For a 2-D matrix this is the op sequence torch.optim.Muon runs, so
    the result is the same: X = U / max(|U|_F, eps), taken wide (transposed when M > N); then `steps`
    times A = X X^T, X <- a X + (b A + c A A) X.
    """
    a, b, c = coefficients
    x = matrix.to(torch.bfloat16, copy=True)  # a copy: the caller's tensor (a momentum buffer) stays
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate scale for a [rows, cols] matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _check_ns(coefficients, steps: int) -> None:
    if steps >= 100:
        raise ValueError(f"ns_steps must be less than 100 (as torch.optim.Muon requires); got {steps}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be a tuple of exactly 3 values (a, b, c); got {coefficients}")


class Muon(WholeMatrixOptimizer):
    """torch.optim.Muon, on `fully_shard`-ed parameters: same constructor, same updates.

    Each matrix's Newton-Schulz iteration runs once in the world, on the rank that owns it (matrices
    are spread across ranks by flops); momentum buffers stay sharded like the parameters, so
    `get_optimizer_state_dict` and DCP checkpoints treat them as AdamW's state. Parameters must be
    2-D, as for torch.optim.Muon (a `ValueError` otherwise), or 3-D: a stack [E, M, N] of E matrices
    (e.g. experts) each updated as torch.optim.Muon updates an [M, N] parameter, batched.
    Optimize other parameters (norms, biases, embeddings) with another optimizer, e.g. AdamW.

    Args: as torch.optim.Muon: lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
    adjust_lr_fn (None or "original": lr * sqrt(max(1, M / N)); "match_rms_adamw":
    lr * 0.2 * sqrt(max(M, N))).
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"a Tensor lr must have one element; got shape {tuple(lr.shape)}")
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0; got {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum must be >= 0; got {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}; got {adjust_lr_fn!r}")
        _check_ns(ns_coefficients, ns_steps)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)

    def check_param(self, param: torch.Tensor) -> None:
        if param.ndim not in (2, 3):
            raise ValueError(
                f"Muon updates 2-D parameters (and 3-D stacks of matrices); got a parameter of shape "
                f"{tuple(param.shape)}: optimize it with another optimizer, e.g. AdamW"
            )

    def transport_dtype(self, group: dict, param: torch.Tensor) -> torch.dtype:
        return torch.bfloat16  # Newton-Schulz casts its input to bfloat16 first and returns bfloat16

    def prepare(self, group: dict, param: torch.Tensor, state: dict) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
        grad, buf = local(param.grad), local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def whole_matrix_update(self, group: dict, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        _check_ns(group["ns_coefficients"], group["ns_steps"])
        return [newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["eps"]) for m in matrices]

    def apply_update(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        rows, cols = param.shape[-2:]
        piece = local(param)
        piece.mul_(1 - lr * group["weight_decay"])
        piece.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))

    def independent_block(self, group: dict, shape: torch.Size) -> tuple[int, ...]:
        """One matrix: each [M, N] of a stack [E, M, N] has its own Newton-Schulz."""
        return (1,) * (len(shape) - 2) + tuple(shape[-2:])

    def matrix_cost(self, group: dict, shape: torch.Size) -> float:
        """Newton-Schulz flops: per step, X X^T and A X cost 2 m^2 n each and A A 2 m^3 (m <= n)."""
        m, n = sorted(shape[-2:])
        num_matrices = math.prod(shape[:-2])
        return float(num_matrices * group["ns_steps"] * (4 * m * m * n + 2 * m ** 3))
