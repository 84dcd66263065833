"""Building blocks shared by the model families."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import decode_ops_cpu, panel_gemm_cpu, small_gemm_cpu
from pdserve.parallel.comm import SINGLE, TPComm
from pdserve.parallel.shard import vocab_shard

PAD_ROWS_BELOW = 64  # larger (prefill) batches are left alone
PACK_ROWS_HINT = 16  # the batch oneDNN lays packed weights out for; any row count works
# fewer rows than this go to the few-row kernel even where a Linear has panels: at 1-2 rows
# it ran a step's products 1.17-1.40x faster than the panel kernel, at 3-4 rows level
# (2 vCPUs, AMD EPYC Zen 4, SmolLM2, three runs of scripts/small_gemm_ab.py); whole decode
# steps at batch 1-3 were level either way (0.93-1.02x, two interleaved runs)
PANEL_FROM_ROWS = 3


def _probe_onednn() -> bool:
    """Whether this torch has oneDNN's packed fp32 linear (internal ops inductor uses)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available()) and out.shape == (2, 8)
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _probe_onednn()


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU weight in oneDNN's blocked layout (where ONEDNN_LINEAR), for
    torch.ops.mkldnn._linear_pointwise."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def _native_rows() -> int:
    """Batches of at most this many rows go through kernels/small_gemm_cpu.py on CPU (fp32):
    `PDSERVE_SMALL_GEMM_ROWS`, 0 to turn it off; 16 by default. Where the kernel cannot
    be built (no C compiler) torch's path runs whatever this says (2 vCPUs, SmolLM2's weights:
    0.74-0.93x oneDNN's time at 1-16 rows, level at 24-32; docs/benchmarks.md)."""
    raw = os.environ.get("PDSERVE_SMALL_GEMM_ROWS", "16")
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"PDSERVE_SMALL_GEMM_ROWS={raw!r}: a row count, 0 to turn off") from None
    if rows < 0:
        raise ValueError(f"PDSERVE_SMALL_GEMM_ROWS={raw!r}: a row count, 0 to turn off")
    return rows


CPU_GEMMS = ("panel", "onednn")


def _cpu_gemm() -> str:
    """Which packed copy an fp32 CPU Linear keeps: `PDSERVE_CPU_GEMM`, `panel` (the C kernel
    of kernels/panel_gemm_cpu.py, the default where it builds) or `onednn` (oneDNN's packed
    product past the few-row kernel's rows, the default before 2026-12-06)."""
    raw = os.environ.get("PDSERVE_CPU_GEMM", "panel")
    if raw not in CPU_GEMMS:
        raise ValueError(f"PDSERVE_CPU_GEMM={raw!r}: one of {', '.join(CPU_GEMMS)}")
    return raw


class Linear(nn.Linear):
    """nn.Linear with fast CPU paths for the small batches decode runs.

    fp32 on CPU where torch has oneDNN, after loading: `pack_for_cpu()` keeps a copy of the
    weight in K-major panels (in place of oneDNN's copy: the weight's size again) and forward
    multiplies PANEL_FROM_ROWS rows or more by it with the C kernel of
    kernels/panel_gemm_cpu.py (2 vCPUs, AMD EPYC Zen 4, one step of SmolLM2's projections:
    1.07-1.44x the few-row kernel at 4-16 rows in the recorded run, 1.12x oneDNN at 32,
    1.04x at 64, 0.95x at 2,048; docs/benchmarks.md); fewer rows go to the few-row kernel
    below. `panel_products` False turns the panels off (for A/B runs). A weight must
    not change after loading but in place through the parameter itself (then the copy is
    dropped): a write through `.data` is not seen.

    Where it is not packed so (`PDSERVE_CPU_GEMM=onednn`, or no C compiler), at most
    `native_rows` rows: the C kernel of kernels/small_gemm_cpu.py, which streams the weight
    in place (a decode step is a pass over the weights).

    Larger fp32 CPU batches there: `pack_for_cpu()` keeps a copy of the weight in oneDNN's
    blocked layout and forward multiplies by it (2 cores, AMD EPYC: SmolLM2's 49152 x 576
    head 5.9 ms at 8 rows vs MKL's 14.8 ms, its 3072 x 576 projection 0.16 vs 0.44 ms; MKL
    takes slow paths on this CPU). The copy costs the weight's size again in memory; it is
    dropped (plain path) if the weight changes afterwards.

    Without the packed copy, a small CPU batch is padded to a multiple of 4 rows: MKL's GEMM
    takes slow paths when the row count is not one (SmolLM2's head: 38 ms for 3 rows, 44 ms
    for 7, 19 ms for 4 or 8).
    """

    native_rows = _native_rows()  # at most this many rows go to the kernel (0: never)
    cpu_gemm = _cpu_gemm()
    panel_products = True  # False: the panel copy is not used (A/B runs)
    packed: torch.Tensor | None = None  # oneDNN's copy
    panels: torch.Tensor | None = None  # the panel kernel's copy
    _packed_from: tuple[int, int] | None = None

    @classmethod
    def kernel_rows(cls, device: torch.device, dtype: torch.dtype) -> int:
        """The most rows that go to the small-GEMM kernel for weights on `device` in `dtype`
        (0: none, e.g. on a GPU, in bf16, or where the kernel does not build)."""
        if device.type != "cpu" or dtype != torch.float32 or not cls.native_rows:
            return 0
        return cls.native_rows if small_gemm_cpu.available() else 0

    @classmethod
    def uses_panels(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether Linears with weights on `device` in `dtype` multiply by panels."""
        return (
            device.type == "cpu"
            and dtype == torch.float32
            and cls.cpu_gemm == "panel"
            and panel_gemm_cpu.available()
        )

    def pack_for_cpu(self) -> bool:
        """Lay an fp32 CPU weight out for the panel kernel (or, with `PDSERVE_CPU_GEMM=onednn`
        or where the kernel does not build, for oneDNN where torch has it); True if packed."""
        w = self.weight
        self.drop_packed()
        # a copy only where there was one before the panel kernel: where torch has oneDNN
        if not (ONEDNN_LINEAR and w.device.type == "cpu" and w.dtype == torch.float32):
            return False
        if self.uses_panels(w.device, w.dtype) and w.stride(1) == 1 and w.shape[1] >= 1:
            self.panels = panel_gemm_cpu.pack(w.detach())
        else:
            self.packed = onednn_pack(w)
        self._packed_from = (w.data_ptr(), w._version)
        return True

    def drop_packed(self) -> None:
        """Forget the packed copies (a weight read directly, never multiplied, needs none)."""
        self.packed = self.panels = None

    def _copy_current(self) -> bool:
        """Whether the packed copy is still the weight's (else it was changed in place
        since, and the copies are dropped)."""
        if self._packed_from == (self.weight.data_ptr(), self.weight._version):
            return True
        self.drop_packed()
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the C kernels and oneDNN's packed product have no backward: torch's product
        # wherever gradients are wanted
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return super().forward(x)
        rows = x.shape[0]
        panels = self.panels is not None and self.panel_products
        # the few-row kernel: where there are no panels, or below the rows they pay from
        few = 0 < rows <= self.native_rows and not (panels and rows >= PANEL_FROM_ROWS)
        if few and x.device.type == "cpu":
            out = small_gemm_cpu.try_small_gemm(x, self.weight, self.bias)
            if out is not None:
                return out
        if panels and self._copy_current():
            out = panel_gemm_cpu.try_panel_gemm(x, self.panels, self.out_features, self.bias)
            if out is not None:
                return out
        if self.packed is not None and x.dtype == torch.float32 and self._copy_current():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
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
        # fp32 on CPU: one C call, not eight ops
        if (out := decode_ops_cpu.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        # Normalise in fp32, scale in the input dtype (as the reference implementations do).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul.

    Under tensor parallelism `intermediate` is the rank's slice and down_proj is row-parallel:
    its partial sums are added over the ranks here, or by the caller when `reduce` is False
    (a mixture of experts sums all its experts first, then reduces once)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool = False,
        comm: TPComm = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.comm = comm if reduce else SINGLE
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # fp32 on CPU: one C call, not three ops
        if (act := decode_ops_cpu.silu_and_mul(gate_up)) is not None:
            return self.comm.all_reduce(self.down_proj(act))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.comm.all_reduce(self.down_proj(F.silu(gate) * up))


class VocabParallelEmbedding(nn.Module):
    """The embedding table, or under tensor parallelism the rank's slice of the vocabulary
    (`vocab_shard` rows from rank * rows; the last slice is padded): a token outside the
    slice embeds as zeros and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden: int, comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.comm = comm
        self.rows = vocab_shard(vocab_size, comm.size)
        self.start = comm.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class StackedLoader:
    """Copies checkpoint tensors into a module's parameters, fusing stacked ones.

    `rules` maps a checkpoint sub-name to (fused sub-name, shard index), e.g.
    ".k_proj." -> (".qkv_proj.", 1); shard i of a fused parameter occupies rows
    `sum(sizes[:i]) : sum(sizes[:i + 1])` of dim 0, with `sizes = shard_sizes[fused sub-name]`
    (an int n instead of a list means n equal shards).
    `check_complete()` names every parameter (or shard) the checkpoint did not provide.
    `sharder(name, tensor, shape)` cuts a global checkpoint tensor to this tensor-parallel
    rank's `shape` (pdserve/parallel/shard.py); without one, tensors are taken whole.
    """

    def __init__(
        self,
        module: nn.Module,
        rules: dict[str, tuple[str, int]],
        shard_sizes: dict[str, list[int] | int],
        sharder=None,
    ) -> None:
        self.params = dict(module.named_parameters())
        self.rules = rules
        self.shard_sizes = shard_sizes
        self.sharder = sharder
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for src, (dst, shard) in self.rules.items():
            if src in name:
                target = name.replace(src, dst)
                param = self._param(target, name)
                sizes = self._sizes(dst, param)
                rows = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                self._copy(rows, self._shard(name, tensor, rows.shape), name)
                self.loaded.add(f"{target}#{shard}")
                return
        param = self._param(name, name).data
        self._copy(param, self._shard(name, tensor, param.shape), name)
        self.loaded.add(name)

    def _shard(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return tensor if self.sharder is None else self.sharder(name, tensor, shape)

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
