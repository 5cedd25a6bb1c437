"""What the loss costs: the cross entropy over the vocabulary, a memory-bound pass.

The output layer's logits are ``s x V / tp`` elements a microbatch on a rank (151,936
columns for Qwen3, 128,256 for Llama 3, 262,144 for Gemma 3), and the loss reads and
writes them several times: for a small model with a large vocabulary this is as long as
a layer or more. FLOPs do not see it; the bytes do, priced at the HBM rate of every other
element-wise kernel (``pipesim.model.memory_traffic.memory_seconds``).

Bytes per logit element, with ``d`` the bytes of the logits' type (2 in BF16) and 4 for
FP32, counted from the code each stack runs (``--cross-entropy``):

- ``unfused``, Megatron-Core's default (``cross_entropy_loss_fusion`` off;
  ``megatron/core/tensor_parallel/cross_entropy.py``, also what Megatron-LM ran in
  2021-2023): forward ``.float()`` (read ``d``, write 4), the max (read 4), the in-place
  subtraction and ``exp`` (read and write 4 each), the sum (read 4) and the division into
  the softmax (read and write 4): ``d + 36``; backward the in-place product with the
  output gradient (read and write 4) and the cast back to the logits' type (read 4, write
  ``d``): ``12 + d``. It keeps the FP32 softmax for the backward: 4 bytes.
- ``fused``, ``--cross-entropy-loss-fusion`` with the native implementation
  (``megatron/core/fusions/fused_cross_entropy.py``): the cast with the max, the
  subtraction with ``exp``, then the sum and the division: ``d + 24`` forward, the same
  ``12 + d`` backward, the same FP32 softmax kept.
- ``te``, ``--cross-entropy-fusion-impl te`` (Transformer Engine's Triton kernels,
  ``transformer_engine/pytorch/triton/cross_entropy.py``): an online softmax reads the
  logits once (``d``); the backward reads them and writes the gradient in their place
  (``2 d``). It keeps the logits in their own type: ``d`` bytes.

- ``torch``, PyTorch's ``F.cross_entropy`` on the logits cast to FP32, as torchtitan's
  eager loss runs it (``cross_entropy_loss``: ``pred.flatten(0, 1).float()``) and
  Hugging Face's models: forward the cast (read ``d``, write 4), ``log_softmax`` (its
  kernel, ``cunn_SoftMaxForward`` in ``aten/src/ATen/native/cuda/SoftMax.cu``, reads a
  row too long for shared memory three times, for the max, the sum of exponentials and
  the output it writes: 12 + 4) and ``nll_loss`` (one element a row): ``d + 20``;
  backward ``nll_loss_backward`` fills a gradient of zeros (write 4), the softmax's
  backward reads that gradient for its sum, then it and the output, and writes the input
  gradient (16), and the cast back (read 4, write ``d``): ``24 + d``. It keeps the FP32
  log-softmax: 4 bytes.
- ``compiled``, the same loss under ``torch.compile`` (torchtitan with ``compile.enable``,
  whose ``compile.components`` name the loss by default): Inductor fuses the cast, the
  softmax's reductions and the gather into one online pass over the logits (read ``d``)
  and keeps them in their own type with a statistic a row (``d``); its backward reads
  them and writes the gradient, a new tensor (``2 d``).

What the loss holds at its worst moment, beyond what it keeps (``cross_entropy_transient_bytes``,
a stage's ``workspace_bytes``): ``unfused`` and ``fused`` cast inside the loss, so the
logits in their own type sit beside the FP32 copy in the forward, and autograd casts the
FP32 gradient back to the logits' type in the backward: ``d`` more. ``te`` works in place:
nothing more. ``torch``'s backward holds the kept log-softmax, the gradient of zeros and
the input gradient at once: 8 more (its forward, ``d + 8`` with the logits, is less).
Over tensor-parallel vocabulary shards torch's loss runs as its own log-softmax over the
shards (``torch.distributed.tensor.parallel.loss_parallel``'s ``_log_softmax`` and its
backward; torchtitan's ``_LossParallelCrossEntropy`` alike), whose backward forms the
exponentials of the kept output, their product with the gradient's sum and the input
gradient beside that gradient: 12 more (its forward holds the logits, their FP32 copy,
the shifted copy and its exponentials at once, ``d + 8`` beyond the kept output: less).
``compiled``'s backward writes the gradient beside the kept logits: ``d`` more.

With FP32 logits the casts are no-ops (``.float()`` returns its input), so they move
nothing. What stacks set: Megatron-Bridge's performance recipes and the Megatron-Core MoE
team's configs take ``te``; NeMo 24.07's Llama configs ``fused``; Megatron-Core without
the flag, and Megatron-LM before the fusion existed, ``unfused``; torchtitan's eager loss
``torch``, its compiled loss ``compiled``.
"""

from __future__ import annotations

CROSS_ENTROPY = ("unfused", "fused", "te", "torch", "compiled")
# torchtitan's loss (torchtitan/components/loss.py): F.cross_entropy on the logits cast to FP32, eager unless
# compile.components names the loss, which the config pipesim writes for it does not
TORCHTITAN_CROSS_ENTROPY = "torch"
FP32_BYTES = 4


def check_cross_entropy(mode: str) -> str:
    """``mode`` if it names a cross-entropy implementation; else a one-line error."""
    if mode not in CROSS_ENTROPY:
        raise ValueError(f"--cross-entropy {mode!r}: use one of {', '.join(CROSS_ENTROPY)} (unfused: Megatron-Core's "
                         "default; fused: --cross-entropy-loss-fusion; te: with --cross-entropy-fusion-impl te; "
                         "torch: F.cross_entropy on FP32 logits, torchtitan's eager loss; compiled: that loss under "
                         "torch.compile)")
    return mode


def cross_entropy_bytes(mode: str, logit_bytes: int) -> tuple[float, float, float]:
    """(forward, backward, kept) bytes a logit element costs under ``mode`` with logits of
    ``logit_bytes`` bytes each (see the module): what the passes move, and what the loss
    holds from its forward to its backward."""
    check_cross_entropy(mode)
    if mode in ("te", "compiled"):  # one online pass; the backward reads the logits and writes their gradient
        return float(logit_bytes), 2.0 * logit_bytes, float(logit_bytes)
    cast = 0 if logit_bytes == FP32_BYTES else logit_bytes + FP32_BYTES  # .float() and the cast back
    if mode == "torch":  # the cast, log_softmax 16, nll_loss; zeros 4, log_softmax's backward 16, the cast back
        return float(cast + 16), float(cast + 20), float(FP32_BYTES)
    if mode == "unfused":  # the cast, then max 4, subtraction 8, exp 8, sum 4, division 8
        forward = cast + 32
    else:  # the max fused with the cast (reading 4 bytes alone), subtraction and exp 8, sum 4, division 8
        forward = (cast or FP32_BYTES) + 20
    return float(forward), float(8 + cast), float(FP32_BYTES)


def cross_entropy_transient_bytes(mode: str, logit_bytes: int, tp: int = 1) -> float:
    """Bytes a logit element costs at the loss's worst moment beyond what the loss keeps
    (``cross_entropy_bytes``'s third figure), under ``mode`` with logits of
    ``logit_bytes`` bytes over ``tp`` vocabulary shards (see the module): held inside one
    forward or backward of the last stage, never across actions."""
    check_cross_entropy(mode)
    if mode == "torch":  # beside the kept log-softmax: the zeros and the input gradient; over tp shards a third copy
        return (3.0 if tp > 1 else 2.0) * FP32_BYTES
    if mode == "te":  # the gradient written in the logits' place
        return 0.0
    if mode == "compiled":  # the gradient, a new tensor beside the kept logits
        return float(logit_bytes)
    return 0.0 if logit_bytes == FP32_BYTES else float(logit_bytes)  # the logits beside their FP32 copy
