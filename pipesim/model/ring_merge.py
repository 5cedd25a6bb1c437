"""What ring attention's merges move through HBM, as Transformer Engine runs them.

Under context parallelism with the ring (``--cp-comm p2p``, Megatron-Core's default:
Transformer Engine's ``AttnFuncWithCPAndKVP2P``), each of a rank's ``cp`` steps runs the
attention kernel on one block of keys and values, and its partial outputs are merged by
their log-sum-exps; the backward accumulates the query and key-value gradients step by
step. The kernels are timed as ``cp`` steps (``pipesim.model.operations``); this module
counts the element-wise passes around them, from the code (its BF16 path: the attention in
the activations' dtype, as Megatron-Core runs it unless ``fp8_dot_product_attention``):

- forward: the keys and values concatenated into the ring's send buffer (``torch.cat``:
  read and write ``KV``); the first step's output scaled into the output
  (``flash_attn_fwd_out_correction_init``: read and write ``O``); each later step's added
  to it (``flash_attn_fwd_out_correction``, one fused pass: read the output and the step's,
  write the output, ``3 O``);
- backward: the keys and values copied into the ring's buffer (``2 KV``); the query
  gradient copied from the first step and added at each later one (``2 Q``, then ``3 Q``
  a step); the key-value gradient likewise, passed round the ring and added to where the
  step's block touched it (``2 KV``, then ``3 KV`` over the part updated).

``Q``, ``O`` and ``KV`` are the bytes of the rank's queries, output and keys plus values.
With Megatron-Core's causal load balancing the ranks differ in which half of a tensor a
later step updates; the count is the ring's last rank, whose every later step updates its
whole output and query gradient and half its key-value gradient (the lower-triangle steps),
the most any rank moves (the ranks meet at every exchange, so the busiest sets the pace).
The log-sum-exp merges (one value a head and token) are left out. The all-gather variant
(``--cp-comm all-gather``) runs each of a rank's two query chunks against its whole prefix
of keys at once and merges nothing.
"""

from __future__ import annotations

CP_COMMS = ("p2p", "all-gather")  # how context-parallel ranks exchange keys and values (--cp-comm)


def ring_merge_bytes(cp: int, query: float, output: float, key_value: float) -> tuple[float, float]:
    """(forward, backward) bytes the merges of ``cp`` ring steps move on one rank, given
    the bytes of its queries, output and keys plus values (see the module)."""
    if cp < 2:
        return 0.0, 0.0
    later = cp - 1
    forward = 2 * key_value + 2 * output + 3 * output * later
    backward = 2 * key_value + (2 * query + 3 * query * later) + (2 * key_value + 1.5 * key_value * later)
    return forward, backward
