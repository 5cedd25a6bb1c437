"""How torchtitan runs a layout's data-parallel replicas when it shards them with FSDP
(``plan --torchtitan --fsdp``), as a job ``pipesim simulate`` prices.

torchtitan wraps every block of a stage in FSDP2's ``fully_shard`` with mixed precision:
parameters gathered in bf16, gradients reduced in float32
(``mixed_precision_reduce = "float32"``, its default). What it then holds depends on
whether the stages are pipelined:

- **Without pipeline parallelism** each block is gathered before its forward and again
  before its backward and freed after each (``reshard_after_forward``, torchtitan's
  default when ``pp == 1``), its gradient reduce-scattered as its backward produces it:
  ZeRO-3 (``--zero 3``), the gradients' shards in float32.
- **With pipeline parallelism** torchtitan leaves ``reshard_after_forward`` off ("to
  avoid per-microbatch all-gathers": ``get_fsdp_reshard_after_forward_policy``), and
  torch's pipelining runtime turns off resharding after the backward and gradient sync
  for every microbatch (``PipelineStage.backward_maybe_with_nosync``: FSDP2 then
  accumulates each unsharded gradient in the reduce type, float32), reducing once in
  ``perform_reduce_grad`` after the stage's last backward. So from a stage's first
  forward to the end of the step it holds its parameters whole in bf16 and their
  gradients whole in float32; only the float32 master parameters and AdamW's moments stay
  sharded, and the reduce-scatter runs after the backward, not beside it. That is
  ``--zero 1 --bytes-per-param 2,4,12 --no-dp-overlap``: the parameters gathered after
  the optimizer step, layer by layer under the next step's first forwards (FSDP's own
  prefetch), as ``--zero 1`` charges them.

``plan --torchtitan --fsdp`` searches only these (``torchtitan_zero``: the other ZeRO
stages ruled out, ``TORCHTITAN_FSDP``) and prices them so (float32 gradients for every
layout, the reduction after the backward where pipelined: ``reduces_after_backward``);
so it ranks only the layouts that fit as torchtitan runs them; ``export --torchtitan
--fsdp`` prices the layout it is given so before writing it, and refuses one that does not
fit (``pipesim.cli.torchtitan``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pipesim.sim.memory import parse_bytes_per_param

if TYPE_CHECKING:
    from pipesim.job import Job

# torchtitan's mixed_precision_reduce default: FSDP2 reduces, and accumulates unsharded, in float32
REDUCE_BYTES = 4
# why plan --torchtitan --fsdp rules out the other ZeRO stages
TORCHTITAN_FSDP = ("torchtitan's FSDP runs as zero3 without pipelining and as zero1 with float32 gradients under it "
                   "(docs/interop.md)")


# the ZeRO stage torchtitan's FSDP runs as under pipelining: every stage's parameters and
# gradients whole for the step, the optimizer state sharded
PIPELINED_ZERO = 1


def torchtitan_zero(pp: int) -> int:
    """The ZeRO stage torchtitan's FSDP runs as (the module): 3 without pipelining,
    ``PIPELINED_ZERO`` with it."""
    return 3 if pp == 1 else PIPELINED_ZERO


def reduces_after_backward(zero: int, shards: int) -> bool:
    """Whether a layout of a plan for torchtitan's FSDP reduces its gradients after the
    backward instead of beside it: the pipelined one (``torchtitan_zero``), where there
    is something to shard over (``shards``: dp x cp)."""
    return zero == PIPELINED_ZERO and shards > 1


def with_reduce_bytes(bytes_per_param: str) -> str:
    """``--bytes-per-param`` with float32 gradients at least, as torchtitan reduces them."""
    per_param = parse_bytes_per_param(bytes_per_param)
    return f"{per_param.weights:g},{max(per_param.grads, REDUCE_BYTES):g},{per_param.optimizer:g}"


def torchtitan_fsdp_job(job: Job) -> Job:
    """``job`` with its ``dp`` replicas as torchtitan's FSDP runs them (the module): ZeRO-3
    with float32 gradient shards without pipelining; with it, every stage's parameters
    and float32 gradients whole for the step and the optimizer state sharded, reduced
    after the backward. A job with nothing to shard over (dp x cp of 1) is returned as it
    is."""
    if job.dp * job.cp <= 1:
        return job
    zero = torchtitan_zero(job.pp)
    return replace(job, zero=zero, bytes_per_param=with_reduce_bytes(job.bytes_per_param),
                   no_dp_overlap=job.no_dp_overlap or reduces_after_backward(zero, job.dp * job.cp))


def torchtitan_fsdp_flags(job: Job) -> str:
    """The ``simulate`` flags that price ``job`` as ``torchtitan_fsdp_job`` does."""
    priced = torchtitan_fsdp_job(job)
    flags = f"--zero {priced.zero} --bytes-per-param {priced.bytes_per_param}"
    flags += " --no-dp-overlap" if priced.no_dp_overlap else ""
    return flags + (f" --cross-entropy {priced.cross_entropy}" if priced.cross_entropy else "")
