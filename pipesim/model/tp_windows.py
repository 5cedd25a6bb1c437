"""Which GEMMs each tensor-parallel collective of a layer can run beside.

Megatron-Core's ``--tp-comm-overlap`` (Transformer Engine's userbuffers) and torch's async
TP hide sequence parallelism's collectives by splitting them into chunks and pipelining
the chunks with *the GEMM that consumes or produces them*, never with anything else:

- the all-gather of a block's input runs beside the block's input projections (QKV, or
  the MLP's gate and up), which read the gathered rows as they arrive
  (``all_gather_matmul``; Transformer Engine's ``ag`` overlap);
- the reduce-scatter of a block's output runs beside the output projection (attention's
  output, the MLP's down projection) that produces the partial sums
  (``matmul_reduce_scatter``; ``rs`` overlap);
- in the backward, the reduce-scatter of the input's gradient (a column-parallel
  projection's) runs beside that projection's input-gradient and weight-gradient
  products (Transformer Engine's bulk overlaps run it under the weight gradient), and the
  all-gather of the output's gradient (a row-parallel projection's) beside the
  input-gradient product it feeds; an input-gradient-only backward (``I``, zero-bubble
  schedules) has only the input-gradient products to hide under.

The norms, the residual adds, the activation and the attention core hide nothing: the
collective on either side of them has to be done before (or cannot start until after)
they run. So a layer whose GEMMs are short beside its collectives (tp 8 on a narrow
model) exposes most of them even with overlap on, which one window of the whole layer's
compute would hide.

``tp_gemm_windows`` gives, per layer, the forward seconds of the four groups
(``TP_WINDOW_FIELDS``): a backward's products are taken as each the forward's time (the
same FLOPs on transposed operands). ``pipesim.sim.parallel.tp_collective_seconds``
prices each collective against its window.
"""

from __future__ import annotations

import functools

from pipesim.model.compute_model import ComputeModel, operation_time
from pipesim.model.operations import Gemm, layer_operations
from pipesim.model.spec import ModelSpec

# StageCost fields, per layer: forward seconds of the GEMMs beside attention's input
# all-gather, its output reduce-scatter, and the MLP's two (pipesim.model.costs)
TP_WINDOW_FIELDS = ("tp_window_attention_in", "tp_window_attention_out", "tp_window_mlp_in", "tp_window_mlp_out")
# the GEMMs of a layer's MLP (pipesim.model.weights.mlp_weights): dense, routed and shared experts, the gates
_MLP_PREFIXES = ("mlp_", "expert_", "shared_expert_", "router")


def window_of(gemm: Gemm) -> int:
    """Index in ``TP_WINDOW_FIELDS`` of the collective ``gemm`` runs beside: the block's
    output side for its output projection (``*_out``), else its input side."""
    mlp = gemm.name.startswith(_MLP_PREFIXES)
    output = gemm.name.endswith("_out")
    return 2 * mlp + output


@functools.lru_cache(maxsize=4096)
def tp_gemm_windows(spec: ModelSpec, tp: int, sequence_parallel: bool, flash_attention: bool,
                    compute: ComputeModel, layer: int = 0, ep: int = 1, cp: int = 1) -> tuple[float, ...]:
    """Forward seconds of layer ``layer``'s weight GEMMs on one rank, summed per
    ``TP_WINDOW_FIELDS`` group (FP8 casts included: they run in the same stream right
    before their GEMM); kept per input, as ``layer_time`` is."""
    windows = [0.0] * len(TP_WINDOW_FIELDS)
    for operation in layer_operations(spec, tp, sequence_parallel, flash_attention, layer, ep=ep, cp=cp):
        if isinstance(operation, Gemm) and operation.weighted and not operation.attention_core:
            windows[window_of(operation)] += operation_time(operation, compute, spec.dtype_bytes).forward
    return tuple(windows)


def backward_windows(forward: tuple[float, ...], split: bool) -> tuple[float, ...]:
    """The windows of a backward from the forward's (see the module): the input side's
    reduce-scatters beside the input- and weight-gradient products (the input-gradient's
    only when ``split``, an ``I``), the output side's all-gathers beside the
    input-gradient product."""
    attention_in, attention_out, mlp_in, mlp_out = forward
    inputs = 1.0 if split else 2.0
    return inputs * attention_in, attention_out, inputs * mlp_in, mlp_out
