"""Building blocks shared by the model families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PAD_ROWS_BELOW = 64  # larger (prefill) batches are left alone


class Linear(nn.Linear):
    """nn.Linear that pads a small CPU batch to a multiple of 4 rows.

    MKL's GEMM takes slow paths when the row count is not a multiple of 4: on 2 cores,
    SmolLM2's 49152 x 576 head takes 38 ms for 3 rows, 44 ms for 7, but 19 ms for 4 or 8;
    its 3072 x 576 projection 0.60 ms for 3 rows and 0.46 ms for 4. Decode batches are
    small and of any size, so padding the few missing rows pays for itself.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        pad = -rows % 4
        if pad and 1 < rows < PAD_ROWS_BELOW and x.device.type == "cpu" and x.dim() == 2:
            return super().forward(F.pad(x, (0, 0, 0, pad)))[:rows]
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the input dtype (as the reference implementations do).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class StackedLoader:
    """Copies checkpoint tensors into a module's parameters, fusing stacked ones.

    `rules` maps a checkpoint sub-name to (fused sub-name, shard index), e.g.
    ".k_proj." -> (".qkv_proj.", 1); shard i of a fused parameter occupies rows
    `sum(sizes[:i]) : sum(sizes[:i + 1])` of dim 0, with `sizes = shard_sizes[fused sub-name]`
    (an int n instead of a list means n equal shards).
    `check_complete()` names every parameter (or shard) the checkpoint did not provide.
    """

    def __init__(
        self,
        module: nn.Module,
        rules: dict[str, tuple[str, int]],
        shard_sizes: dict[str, list[int] | int],
    ) -> None:
        self.params = dict(module.named_parameters())
        self.rules = rules
        self.shard_sizes = shard_sizes
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for src, (dst, shard) in self.rules.items():
            if src in name:
                target = name.replace(src, dst)
                param = self._param(target, name)
                sizes = self._sizes(dst, param)
                rows = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                self._copy(rows, tensor, name)
                self.loaded.add(f"{target}#{shard}")
                return
        self._copy(self._param(name, name).data, tensor, name)
        self.loaded.add(name)

    def check_complete(self) -> None:
        missing = []
        for pname in self.params:
            fused = next((dst for dst in self.shard_sizes if dst in pname), None)
            if fused is None:
                keys = [pname]
            else:
                n = len(self._sizes(fused, self.params[pname]))
                keys = [f"{pname}#{i}" for i in range(n)]
            missing += [k for k in keys if k not in self.loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _sizes(self, fused: str, param: torch.Tensor) -> list[int]:
        sizes = self.shard_sizes[fused]
        if isinstance(sizes, int):
            return [param.shape[0] // sizes] * sizes
        return sizes

    def _param(self, target: str, source: str) -> nn.Parameter:
        if target not in self.params:
            raise ValueError(f"checkpoint tensor {source!r} has no place in the model")
        return self.params[target]

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(src.to(dst.dtype))
