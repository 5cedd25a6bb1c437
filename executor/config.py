"""What one pipelined run is asked to do: the schedule, the model, the data, the optimizer.

Plain data with no torch import, so the command line can build and check a config (and
pickle it to every rank) without loading torch until a run really starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from executor.lr_schedule import LR_DECAYS
from schedules.generators import COST_AWARE, GROUPED, V_SHAPED, generate
from schedules.generators.interleaved import require_microbatch_group
from schedules.lowering import lower
from schedules.schedule import Schedule

MODELS = ("mlp", "gpt")  # the toys; --model also takes an architecture (executor.architectures.build)
OPTIMIZERS = ("sgd", "adamw")
BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("float32", "float64", "bfloat16", "float16")
MIXED_DTYPES = ("bfloat16", "float16")  # compute under autocast over float32 master weights

# Each optimizer's own defaults: (learning rate, weight decay on matrices). AdamW's are the
# LLM-pretraining values of LLaMA (Touvron et al. 2023, sec. 2.2: AdamW, betas (0.9, 0.95),
# weight decay 0.1, peak lr 3e-4 for the 7B and 13B models), also GPT-3's betas and decay
# (Brown et al. 2020, appendix B); SGD keeps the executor's long-standing 0.01 and no decay.
OPTIMIZER_DEFAULTS = {"sgd": (0.01, 0.0), "adamw": (3e-4, 0.1)}
ADAMW_BETAS = (0.9, 0.95)
FAILURE_MODES = ("raise", "kill", "hang")
P2P_SEMANTICS = ("rendezvous", "buffered")  # as schedules.p2p names them
NORM_MLA_UP = "norm-mla-up"  # DeepSeek-V3's recompute of the norms and latent attention's up-projections
RECOMPUTE_MODES = ("none", "selective", "full", "per-op", NORM_MLA_UP)  # as pipesim.model.spec names them
CP_COMMS = ("all-gather", "p2p")  # as pipesim.sim.context_parallel names them


class ConfigError(ValueError):
    """A run was asked for with values that cannot work; the message names the flag."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to run its share of a pipelined training step.

    ``layout`` gives the number of model layers on each stage (``pp * virtual_stages``
    entries, summing to ``layers``); ``None`` splits them as evenly as possible.
    ``custom_schedule`` runs a given ``Schedule`` (compute-only or lowered, e.g. read
    from CSV) instead of generating ``schedule``; its pp and microbatches must match.
    ``schedule_file`` is the CSV it was read from (``--schedule-file``), kept so results
    say what ran.
    ``prefetch_recvs`` posts every receive at the start of a step (default: on gloo,
    which matches transfers by tag; never on NCCL, which matches them by order).
    ``dp`` replicas each run the pipeline on their own slice of the global
    ``batch_size`` (which ``dp`` must divide), cut into ``microbatches``; ``tp`` splits
    every gpt block across that many ranks (``sequence_parallel`` adds Megatron's
    sequence parallelism). World size is ``dp * pp * tp``. ``dp_bucket_mb`` is the size
    of the gradient all-reduce buckets (DDP's default 25). ``zero`` 1 shards the
    optimizer state over the dp replicas (gradients reduce-scattered, parameters
    all-gathered after the step), 2 the gradients too (``executor.data_parallel``), 3
    the parameters too (FSDP2's ``fully_shard``, ``executor.fsdp``).
    ``recompute`` ``full`` or ``selective`` checkpoints each block, or only its attention
    core; ``per-op`` each block with torchtitan's per-op policy (``executor.recompute``).
    ``p2p`` names the point-to-point semantics the run is checked and run under:
    ``rendezvous`` (NCCL's rule; on gloo emulated by a handshake, receives never posted
    ahead) or ``buffered`` (gloo's); ``None`` takes the backend's own.
    ``lr`` and ``weight_decay`` default (``None``) to the optimizer's own values
    (``OPTIMIZER_DEFAULTS``); weight decay applies to matrices only, never to biases or
    norm weights. ``dtype`` ``float32``/``float64`` runs the whole model in that type;
    ``bfloat16``/``float16`` keeps float32 master weights and computes under autocast in
    that type (activations cross stages in it; ``float16`` adds dynamic loss scaling).
    ``grad_reduce_dtype`` is the type the dp gradient all-reduce sends (default: the
    master weights' type).
    ``inject_failure`` (``"RANK:ACTION:MODE"``, e.g. ``"1:1B0:kill"``) makes that rank
    raise, die or hang just before that action of the first step: it exists so the failure
    path can be tested and demonstrated, never set it in a real run.
    """

    schedule: str = "1f1b"
    pp: int = 2
    dp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int | None = None  # parallel folding: the routed experts' own tp, 1 or tp (None: tp, no folding)
    cp: int = 1
    cp_comm: str = "p2p"  # the ring, as simulate prices cp by default
    sequence_parallel: bool = False
    dp_bucket_mb: float = 25.0
    zero: int = 0
    recompute: str = "none"
    recompute_moe_act: bool = False  # Megatron-Core's moe_act: the experts' activation rebuilt for the backward
    microbatches: int = 4
    virtual_stages: int = 1
    microbatch_group: int | None = None  # interleaved-1f1b's N (schedules.generators.interleaved); None: its own
    ep_overlap: bool = False  # combined 1F1B (schedules.generators.combined), Megatron-Core's EP all-to-all overlap
    model: str = "mlp"
    layers: int = 4
    hidden: int = 64
    batch_size: int = 8
    seq_len: int = 16
    vocab: int = 128
    heads: int = 4
    steps: int = 1
    seed: int = 0
    optimizer: str = "sgd"
    lr: float | None = None
    weight_decay: float | None = None
    clip_grad: float | None = None  # the gradients' global norm clipped to this (executor.grad_clip); None: not
    lr_warmup: int = 0  # steps of linear warm-up (executor.lr_schedule)
    lr_decay: str = "none"  # after it: none, linear or cosine, over the rest of the run
    min_lr_ratio: float = 0.0  # the decay's floor, a share of the learning rate
    dtype: str = "float32"
    grad_reduce_dtype: str | None = None
    backend: str = "auto"
    timeout: float = 60.0
    threads: int = 1
    layout: tuple[int, ...] | None = None
    inject_failure: str | None = None
    return_grads: bool = False
    custom_schedule: Schedule | None = None
    schedule_file: str | None = None
    prefetch_recvs: bool | None = None
    p2p: str | None = None
    # Architectures (--model a preset or a config.json, executor.architectures.build): what no
    # field above gives; None scales the original's proportions. ``data`` is a local text
    # file read byte by byte (executor.token_data); None: synthetic tokens.
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    qkv: str = "separate"  # Q, K and V as three linears or one wqkv (pipesim.model.spec.QKV_PROJECTIONS)
    experts: int | None = None
    capacity_factor: float | None = None
    expert_bias_rate: float | None = None  # DeepSeek-V3's selection-bias step; None: 0.001 where a model has one
    balance_loss: float | None = None  # the MoE load-balancing loss's coefficient; None: the model's
    data: str | None = None

    @property
    def copies(self) -> int:
        """Copies of the model along the pipeline: DualPipe's two, one fed from each end
        (``schedules.generators.dualpipe``), else one."""
        return 2 if self.custom_schedule is None and self.schedule == "dualpipe" else 1

    @property
    def gradient_holders(self) -> int:
        """Processes that hold each dense parameter and reduce its gradient (ZeRO shards
        over them): every dp replica and cp rank, with DualPipe both copies' holders
        (``executor.copies``)."""
        return self.dp * self.cp * self.copies

    @property
    def expert_tp(self) -> int:
        """Ranks each routed expert is split over: ``etp``, else ``tp`` (Megatron-Core's default)."""
        return self.tp if self.etp is None else self.etp

    @property
    def folded(self) -> bool:
        """Whether the experts are folded (``executor.expert_parallel``): whole on each rank of
        a tensor-parallel group, their ep groups cut from every tp x cp x dp rank of a stage."""
        return self.expert_tp != self.tp

    @property
    def routes_shards(self) -> bool:
        """Whether each tp rank routes its own sequence shard through the mixture of
        experts, as Megatron-Core does (``executor.shard_routing``): under tp with sequence
        parallelism, folded or with expert parallelism. Elsewhere (no sequence parallelism;
        ep 1 with the experts split over tp) every tp rank routes the gathered sequence."""
        return self.tp > 1 and self.sequence_parallel and (self.folded or self.ep > 1)

    @property
    def expert_members(self) -> int:
        """The ranks of a stage the ep groups are cut from: its dp x cp ranks, and under
        parallel folding its tp x cp x dp ranks."""
        return self.dp * self.cp * (self.tp if self.folded else 1)

    @property
    def split_ranks(self) -> tuple[int, ...] | None:
        """The rank each stage's load counts toward when the default split balances ranks,
        as ``pipesim simulate`` splits the schedule (``pipesim.model.stage_split``): a given
        schedule's own placement where a rank holds both ends of the model, the V shapes'
        and DualPipe's folded ranks; None (stage by stage) for the looped ones."""
        from pipesim.model.stage_split import ends_on_one_rank, folded_ranks  # noqa: PLC0415

        if self.custom_schedule is not None:
            return ends_on_one_rank(self.custom_schedule.placement)
        return folded_ranks(self.num_stages) if self.schedule in V_SHAPED else None

    @property
    def num_stages(self) -> int:
        """The model's stages: pp x virtual stages, over the copies (DualPipe's pp: each
        rank holds one stage of each copy)."""
        return self.pp * self.virtual_stages // self.copies

    @property
    def world_size(self) -> int:
        """Processes the run needs: one per (dp, pp, tp, cp) position."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def boundary_sequence_split(self) -> int:
        """Parts each sequence of a stage-boundary activation is cut into: one per cp
        rank, and with sequence parallelism one per tp rank within that, each rank
        sending its own part to its peer of the next stage (Megatron-Core's
        ``seq/tp x batch x hidden`` messages, ``executor.tensor_parallel``)."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def replica_batch_size(self) -> int:
        """Samples each dp replica runs per step (its slice of the global batch)."""
        return self.batch_size // self.dp

    def p2p_semantics(self, backend: str) -> str:
        """The P2P semantics on ``backend`` (resolved, not ``auto``): ``p2p`` when given,
        else NCCL's rendezvous on nccl and gloo's buffering on gloo."""
        if self.p2p is not None:
            return self.p2p
        return "rendezvous" if backend == "nccl" else "buffered"

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimizer's default learning rate."""
        return OPTIMIZER_DEFAULTS[self.optimizer][0] if self.lr is None else self.lr

    @property
    def decay(self) -> float:
        """``weight_decay``, or the optimizer's default (applied to matrices only)."""
        return OPTIMIZER_DEFAULTS[self.optimizer][1] if self.weight_decay is None else self.weight_decay

    @property
    def master_dtype(self) -> str:
        """The type the weights, their gradients and the loss are kept in."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def reduce_dtype(self) -> str:
        """The type the dp gradient all-reduce sends."""
        return self.grad_reduce_dtype or self.master_dtype

    def prefetch_receives(self, backend: str) -> bool:
        """Whether receives are posted ahead on this backend (see ``prefetch_recvs``):
        never under rendezvous semantics, where a receive is posted at its place."""
        if backend == "nccl" or self.p2p_semantics(backend) == "rendezvous":
            return False
        return True if self.prefetch_recvs is None else self.prefetch_recvs

    def check(self) -> None:
        """Raise ``ConfigError`` naming the flag when a value cannot work."""
        check_rank_values(self)
        for flag, value in (("--pp", self.pp), ("--dp", self.dp), ("--tp", self.tp), ("--ep", self.ep),
                            ("--cp", self.cp), ("--microbatches", self.microbatches),
                            ("--virtual-stages", self.virtual_stages), ("--layers", self.layers),
                            ("--hidden", self.hidden), ("--batch-size", self.batch_size),
                            ("--steps", self.steps), ("--threads", self.threads)):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        for flag, value, valid in (("--optimizer", self.optimizer, OPTIMIZERS),
                                   ("--backend", self.backend, BACKENDS), ("--dtype", self.dtype, DTYPES),
                                   ("--grad-reduce-dtype", self.reduce_dtype, DTYPES),
                                   ("--recompute", self.recompute, RECOMPUTE_MODES)):
            if value not in valid:
                raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(valid)}")
        check_optimizer(self)
        check_model(self)
        if self.batch_size % self.dp:
            raise ConfigError(
                f"--batch-size {self.batch_size} cannot be split evenly across --dp {self.dp} replicas; "
                f"use a multiple of {self.dp}"
            )
        if self.replica_batch_size < self.microbatches:
            per = f" per replica ({self.replica_batch_size} of each --dp {self.dp} slice)" if self.dp > 1 else ""
            raise ConfigError(
                f"--batch-size {self.batch_size} cannot be cut into {self.microbatches} microbatches{per}; "
                f"use --batch-size >= {self.microbatches * self.dp}"
            )
        if self.dp_bucket_mb <= 0:
            raise ConfigError(f"--dp-bucket-mb must be positive, got {self.dp_bucket_mb}")
        check_tensor_parallel(self)
        check_zero(self)
        check_microbatch_group(self)
        check_expert_tp(self)
        check_expert_parallel(self)
        check_moe_act_recompute(self)
        check_ep_overlap(self)
        check_context_parallel(self)
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if self.model == "gpt" and self.hidden % self.heads:
            raise ConfigError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.layout is not None:
            if len(self.layout) != self.num_stages or sum(self.layout) != self.layers or min(self.layout) < 0:
                raise ConfigError(
                    f"--layout {','.join(map(str, self.layout))} must give {self.num_stages} stage sizes "
                    f"(pp x virtual stages) that are >= 0 and sum to --layers {self.layers}"
                )
        elif self.layers < self.num_stages and self.model == "mlp":
            raise ConfigError(
                f"--layers {self.layers} cannot fill {self.num_stages} stages of an mlp; "
                f"use --layers >= {self.num_stages} or give a --layout"
            )
        if self.custom_schedule is None and self.schedule in COST_AWARE:
            chunks = f" -v {self.virtual_stages}" if self.schedule == "interleaved-auto" else ""
            raise ConfigError(
                f"--schedule {self.schedule} builds its order from stage costs: write it with `pipesim export "
                f"--schedule {self.schedule} --pp {self.pp} -m {self.microbatches}{chunks} --costs COSTS.json --out "
                f"{self.schedule}.csv` (costs from `pipesim profile`) and run that with --schedule-file"
            )
        if self.custom_schedule is not None:
            custom = self.custom_schedule
            if (custom.pp, custom.microbatches, custom.num_stages) != (self.pp, self.microbatches, self.num_stages):
                raise ConfigError(
                    f"schedule {custom.name!r} has pp={custom.pp}, microbatches={custom.microbatches}, "
                    f"stages={custom.num_stages}; the run asks for pp={self.pp}, "
                    f"microbatches={self.microbatches}, stages={self.num_stages}"
                )
        if self.p2p is not None and self.p2p not in P2P_SEMANTICS:
            raise ConfigError(f"--p2p {self.p2p!r} is not one of: {', '.join(P2P_SEMANTICS)}")
        if self.p2p == "buffered" and self.backend == "nccl":
            raise ConfigError("--p2p buffered describes gloo; NCCL matches in posting order and a send may wait "
                              "for its receive: use --p2p rendezvous (the default on nccl)")
        check_schedule_and_failure(self)


def check_optimizer(config: RunConfig) -> None:
    """A weight decay must be a finite number >= 0, a clipping norm one > 0, the learning
    rate's schedule whole steps, a known decay and a floor within the rate (the rate
    itself is checked with the other rank values)."""
    if config.weight_decay is not None and not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be a finite number >= 0, got {config.weight_decay}")
    if config.clip_grad is not None and not (math.isfinite(config.clip_grad) and config.clip_grad > 0):
        raise ConfigError(f"--clip-grad must be a finite number > 0 (leave it out not to clip), got {config.clip_grad}")
    if config.lr_warmup < 0:
        raise ConfigError(f"--lr-warmup must be a number of steps >= 0, got {config.lr_warmup}")
    if config.lr_decay not in LR_DECAYS:
        raise ConfigError(f"--lr-decay {config.lr_decay!r} is not one of: {', '.join(LR_DECAYS)}")
    if not (math.isfinite(config.min_lr_ratio) and 0 <= config.min_lr_ratio <= 1):
        raise ConfigError(f"--min-lr-ratio must be a share of the learning rate, between 0 and 1, "
                          f"got {config.min_lr_ratio}")


def check_model(config: RunConfig) -> None:
    """A toy model (mlp, gpt) or an architecture the executor builds
    (``executor.architectures.build``, which checks its sizes, tp and stage split); ``--data``
    a readable text file, for a model of tokens whose vocabulary holds its bytes."""
    from executor.architectures.build import check_architecture, is_architecture  # noqa: PLC0415 - it imports this module
    from executor.token_data import BYTE_VOCAB, check_data_file  # noqa: PLC0415
    from pipesim.model.spec import QKV_PROJECTIONS  # noqa: PLC0415

    if config.qkv not in QKV_PROJECTIONS:
        raise ConfigError(f"--qkv {config.qkv!r} is not one of: {', '.join(QKV_PROJECTIONS)}")
    if config.recompute == NORM_MLA_UP and config.model == "mlp":
        raise ConfigError(f"--recompute {NORM_MLA_UP} recomputes the norms' outputs (and latent attention's "
                          "up-projections); --model mlp has neither: use --model gpt or an architecture")
    if is_architecture(config.model):
        check_architecture(config)
    else:
        if config.qkv != "separate":
            raise ConfigError(f"--qkv {config.qkv} builds an architecture's Q, K and V as one wqkv (--model llama3-8b, "
                              f"a config.json); --model {config.model} has "
                              + ("no attention" if config.model == "mlp" else "its own packed, biased qkv linear"))
        for flag, value in (("--kv-heads", config.kv_heads), ("--ffn-hidden", config.ffn_hidden),
                            ("--experts", config.experts), ("--capacity-factor", config.capacity_factor),
                            ("--expert-bias-rate", config.expert_bias_rate), ("--balance-loss", config.balance_loss)):
            if value is not None:
                raise ConfigError(f"{flag} shapes an architecture (--model llama3-8b, mixtral-8x7b, a config.json); "
                                  f"--model {config.model} has no such part")
    if config.data is None:
        return
    if config.model == "mlp":
        raise ConfigError("--data trains on text tokens; --model mlp takes vectors "
                          "(use --model gpt or an architecture)")
    if config.vocab < BYTE_VOCAB:
        raise ConfigError(f"--data is read byte by byte (vocabulary {BYTE_VOCAB}: 256 bytes, BOS, EOS); "
                          f"--vocab {config.vocab} is too small")
    check_data_file(config.data)


ZERO_STAGES = (0, 1, 2, 3)


def check_zero(config: RunConfig) -> None:
    """ZeRO shards over the dp replicas (with cp the dp x cp ranks, with ep the routed
    experts over their expert data-parallel group, with DualPipe both copies' holders):
    it needs more than one such rank."""
    if config.zero not in ZERO_STAGES:
        raise ConfigError(f"--zero {config.zero} is not one of: {', '.join(map(str, ZERO_STAGES))}")
    if config.zero and config.gradient_holders == 1:
        raise ConfigError(f"--zero {config.zero} shards over data-parallel replicas; it needs --dp > 1 (or --cp > 1: "
                          "ZeRO shards over the dp x cp ranks; or --schedule dualpipe, over both copies' holders)")


def check_tensor_parallel(config: RunConfig) -> None:
    """Tensor parallelism splits gpt heads and MLP features: tp must divide both
    (architectures: ``executor.architectures.build.check_tensor_parallel``)."""
    if config.tp == 1:
        if config.sequence_parallel:
            raise ConfigError("--sequence-parallel needs --tp > 1")
        return
    if config.model != "gpt" and config.model in MODELS:
        raise ConfigError(f"--tp {config.tp} splits transformer blocks; use --model gpt (got --model {config.model})")
    if config.model == "gpt" and config.heads % config.tp:
        raise ConfigError(f"--tp {config.tp} must divide --heads {config.heads} (each tp rank holds whole heads)")
    if config.hidden % config.tp:
        raise ConfigError(f"--tp {config.tp} must divide --hidden {config.hidden}")
    if config.sequence_parallel and config.seq_len % config.tp:
        raise ConfigError(f"--sequence-parallel: --tp {config.tp} must divide --seq-len {config.seq_len}")


def check_expert_parallel(config: RunConfig) -> None:
    """Expert parallelism splits the routed experts of an MoE architecture over ep groups
    cut from the dp x cp ranks (``executor.expert_parallel``): ep must divide dp x cp
    and the experts."""
    if config.ep == 1:
        return
    from executor.architectures.build import full_spec, is_architecture, shrunk_spec  # noqa: PLC0415 - it imports this module

    if not is_architecture(config.model) or full_spec(config.model).moe is None:
        raise ConfigError(f"--ep {config.ep} splits the experts of a mixture-of-experts model; use e.g. --model "
                          f"mixtral-8x7b (got --model {config.model})")
    if config.expert_members % config.ep:
        if config.folded:
            raise ConfigError(f"--ep {config.ep} must divide the tp x cp x dp = {config.expert_members} ranks of a "
                              f"stage (under --etp {config.etp} the expert-parallel groups are cut from all of them)")
        ranks = f"--dp {config.dp}" if config.cp == 1 else f"the dp x cp = {config.dp * config.cp} ranks"
        raise ConfigError(f"--ep {config.ep} must divide {ranks} (expert-parallel groups are cut from the dp x cp "
                          f"ranks)")
    experts = shrunk_spec(config).moe.experts
    if experts % config.ep:
        raise ConfigError(f"--ep {config.ep} must divide the {experts} experts (set by --experts)")


def check_moe_act_recompute(config: RunConfig) -> None:
    """``--recompute-moe-act`` (Megatron-Core's ``moe_act``, ``executor.recompute``) needs
    a mixture-of-experts architecture, and is refused beside a ``--recompute`` that re-runs
    the whole block (``full``) or runs no experts (``per-op``), as ``simulate`` refuses it."""
    if not config.recompute_moe_act:
        return
    from executor.architectures.build import full_spec, is_architecture  # noqa: PLC0415 - it imports this module

    if not is_architecture(config.model) or full_spec(config.model).moe is None:
        raise ConfigError(f"--recompute-moe-act recomputes the routed experts' activation of a mixture-of-experts "
                          f"model; use e.g. --model mixtral-8x7b (got --model {config.model})")
    from pipesim.model.spec import moe_act_conflict  # noqa: PLC0415

    why = moe_act_conflict(config.recompute)
    if why:
        raise ConfigError(f"--recompute-moe-act conflicts with --recompute {config.recompute}: {why}")


def check_expert_tp(config: RunConfig) -> None:
    """``--etp`` (Megatron-Core's parallel folding, ``--expert-tensor-parallel-size``): the
    executor runs the experts split over tp (``--etp`` = ``--tp``, the default) or whole on
    every rank (``--etp 1``, as Megatron-Core's MoE recipes fold them), with sequence
    parallelism where tp > 1, as Megatron-Core and ``simulate`` require."""
    etp = config.etp
    if etp is None:
        return
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
        raise ConfigError(f"--etp must be a whole number >= 1, got {etp!r}")
    from executor.architectures.build import full_spec, is_architecture  # noqa: PLC0415 - it imports this module

    if not is_architecture(config.model) or full_spec(config.model).moe is None:
        raise ConfigError(f"--etp {etp} splits the routed experts of a mixture-of-experts model; use e.g. --model "
                          f"mixtral-8x7b (got --model {config.model})")
    if etp > config.tp:
        raise ConfigError(f"--etp {etp} above --tp {config.tp} (experts split over more ranks than attention) is not "
                          f"run; use --etp 1 or {config.tp}")
    if etp not in (1, config.tp):
        raise ConfigError(f"--etp {etp}: the executor runs the routed experts whole on every rank (--etp 1, parallel "
                          f"folding as Megatron-Core's MoE recipes run it) or split over tp (--etp {config.tp}); "
                          f"`pipesim simulate` prices any --etp dividing --tp")
    if config.folded and not config.sequence_parallel:
        raise ConfigError(f"--etp {etp} with --tp {config.tp} needs --sequence-parallel: under parallel folding each "
                          "rank dispatches its own shard of the sequence to the experts")


def check_context_parallel(config: RunConfig) -> None:
    """Context parallelism splits each sequence of a transformer (the toy gpt or an
    architecture; rotary or learned positions, each rank embedding and rotating at its
    tokens' true positions) into ``2 cp`` chunks (``executor.context_parallel``), its
    keys and values all-gathered or passed round a ring (``--cp-comm``)."""
    if config.cp == 1:
        return
    if config.cp_comm not in CP_COMMS:
        raise ConfigError(f"--cp-comm {config.cp_comm!r} is not one of: {', '.join(CP_COMMS)} (p2p: ring attention, "
                          f"all-gather: Llama 3's gathered keys and values)")
    if config.model == "mlp":
        raise ConfigError(f"--cp {config.cp} splits each sequence of a transformer; --model mlp has no sequence: use "
                          "--model gpt or an architecture")
    if config.seq_len % (2 * config.cp):
        raise ConfigError(f"--cp {config.cp} cuts each sequence into {2 * config.cp} equal chunks: --seq-len "
                          f"{config.seq_len} must be a multiple of {2 * config.cp}")
    if config.sequence_parallel and (config.seq_len // config.cp) % config.tp:
        raise ConfigError(f"--sequence-parallel with --cp {config.cp}: --tp {config.tp} must divide each cp rank's "
                          f"{config.seq_len // config.cp} tokens of --seq-len {config.seq_len}")
    if config.capacity_factor is not None:
        raise ConfigError(f"--cp {config.cp} with --capacity-factor: capacity counts a whole sequence's tokens, "
                          f"which no cp rank holds; run dropless (no --capacity-factor)")


def check_microbatch_group(config: RunConfig) -> None:
    """``--microbatch-group``: for the schedules that group microbatches, in Megatron-Core's
    range for the run's pp and microbatches (``require_microbatch_group``)."""
    if config.microbatch_group is None:
        return
    if config.custom_schedule is not None or config.schedule not in GROUPED:
        raise ConfigError(f"--microbatch-group {config.microbatch_group} conflicts with --schedule "
                          f"{config.schedule}: only {', '.join(sorted(GROUPED))} runs microbatches in groups per "
                          "model chunk")
    try:
        require_microbatch_group(config.pp, config.microbatches, config.microbatch_group)
    except ValueError as error:
        raise ConfigError(f"--microbatch-group {config.microbatch_group}: {error}") from None


def check_ep_overlap(config: RunConfig) -> None:
    """``--ep-overlap`` (combined 1F1B) where Megatron-Core runs it, by ``simulate``'s rule
    (``schedules.generators.combined.combined_problem``), and on a generated order only (a
    given one fixes its own pairs)."""
    if not config.ep_overlap:
        return
    from schedules.generators.combined import combined_problem  # noqa: PLC0415

    if config.custom_schedule is not None:
        raise ConfigError("--ep-overlap conflicts with a given schedule: combined 1F1B is an order of its own; drop "
                          "--ep-overlap or the schedule")
    problem = combined_problem(config.schedule, config.pp, config.ep, config.recompute)
    if problem:
        raise ConfigError(problem)


def build_schedule(config: RunConfig) -> Schedule:
    """The lowered schedule named by the config: the exact programs that will run."""
    if config.custom_schedule is not None:
        return lower(config.custom_schedule)
    if config.ep_overlap:
        from schedules.generators.combined import combined_1f1b  # noqa: PLC0415

        return lower(combined_1f1b(config.schedule, config.pp, config.microbatches, config.virtual_stages,
                                   config.microbatch_group))
    return lower(generate(config.schedule, config.pp, config.microbatches, config.virtual_stages,
                          microbatch_group=config.microbatch_group))


def parse_failure(text: str) -> tuple[int, str, str]:
    """``"1:1B0:kill"`` -> ``(1, "1B0", "kill")``; raise naming the expected form."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] not in FAILURE_MODES:
        raise ConfigError(
            f"--inject-failure {text!r} must be RANK:ACTION:MODE with MODE one of "
            f"{', '.join(FAILURE_MODES)}, e.g. '1:1B0:kill'"
        )
    return int(parts[0]), parts[1], parts[2]


def even_layout(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible; the extra layers go to the middle stages,
    because the first stage also holds the embedding and the last the head and loss."""
    base, extra = divmod(layers, stages)
    sizes = [base] * stages
    order = sorted(range(stages), key=lambda stage: (stage in (0, stages - 1), abs(stage - (stages - 1) / 2)))
    for stage in order[:extra]:
        sizes[stage] += 1
    return tuple(sizes)


MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds; torch turns the timeout into an integer count of ms


def check_rank_values(config: RunConfig) -> None:
    """The values only a rank would trip over (a zero-sized vocabulary, a NaN learning
    rate, an infinite timeout), refused here before any process starts."""
    for flag, value in (("--heads", config.heads), ("--vocab", config.vocab), ("--seq-len", config.seq_len)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    lr = 0.0 if config.lr is None else config.lr  # None: the optimizer's own default, always valid
    for flag, value in (("--lr", lr), ("--dp-bucket-mb", config.dp_bucket_mb), ("--timeout", config.timeout)):
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
    if lr < 0:
        raise ConfigError(f"--lr must be >= 0, got {lr}")
    if config.model == "mlp" and config.layout is not None and 0 in config.layout:
        stage = config.layout.index(0)
        raise ConfigError(
            f"--layout {','.join(map(str, config.layout))} gives stage {stage} no layers; an mlp stage has "
            "nothing else to train, so every stage needs at least one layer"
        )
    if config.timeout > MAX_TIMEOUT:
        raise ConfigError(f"--timeout must be at most {MAX_TIMEOUT:g} seconds (7 days), got {config.timeout:g}")


# recompute modes whose checkpoint lets one backward through a block: no I/W split with them
ONE_BACKWARD_RECOMPUTE = ("per-op",)
# why per-op recompute (torch's selective checkpointing, torchtitan's SelectiveAC) cannot
# run an order with I and W: each saved output is handed to one backward through the block
PER_OP_SPLIT_FAILS = ("torch's selective activation checkpointing lets one backward through each block, and I then W "
                      "go through it twice (\"Trying to backward an extra time\")")


def has_split_backward(schedule: Schedule) -> bool:
    """Whether the order splits a backward into input (I) and weight (W) halves."""
    return any(action.kind in ("I", "W") for program in schedule.programs for action in program)


def check_schedule_and_failure(config: RunConfig) -> None:
    """The schedule must be one that can be built (``--virtual-stages 2`` needs a
    multi-chunk schedule), and ``--inject-failure`` must name a rank that exists and an
    action in that rank's lowered program, or the injected failure would never fire."""
    try:
        schedule = build_schedule(config)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.recompute in ONE_BACKWARD_RECOMPUTE and has_split_backward(schedule):
        raise ConfigError(f"--recompute {config.recompute} cannot run a split backward: schedule {schedule.name!r} "
                          f"splits B into I and W, and {PER_OP_SPLIT_FAILS}; use a schedule with whole backwards "
                          "(gpipe, 1f1b, interleaved-1f1b) or --recompute selective or full")
    if config.inject_failure is None:
        return
    rank, action, _ = parse_failure(config.inject_failure)
    if rank >= config.world_size:
        raise ConfigError(
            f"--inject-failure {config.inject_failure!r}: rank {rank} does not exist; "
            f"the run has ranks 0 to {config.world_size - 1}"
        )
    pipeline_rank = rank // (config.dp * config.cp * config.tp)  # tp innermost, then cp, dp, pp (executor.mesh)
    program = [str(step) for step in schedule.programs[pipeline_rank]]
    if action not in program:
        raise ConfigError(
            f"--inject-failure {config.inject_failure!r}: rank {rank} (pipeline rank {pipeline_rank}) never runs "
            f"{action}; its program is {' '.join(program[:12])}{' ...' if len(program) > 12 else ''}"
        )
