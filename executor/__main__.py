"""Per-rank entry point for users who start the ranks themselves with torchrun::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m executor \\
        --schedule 1f1b --pp 16 --microbatches 64 --model gpt --layers 32

Every rank runs the same command; rank 0 prints the summary and writes ``--json`` and
``--trace``. A bad flag, a flag of another pipesim command (``--topology``, simulate's;
``--html``, run's) or a value only the simulator takes (``--p2p torch-runtime``) is
refused in one line with exit status 2, as ``pipesim run`` refuses them.
"""

from __future__ import annotations

import argparse
import os
import sys

from executor.config import ConfigError
from executor.options import add_run_arguments, config_from_args
from executor.refused_flags import REFUSED_FLAGS, add_refused_flags, flag_refusal
from executor.refused_values import SIMULATOR_CHOICES, admit_refused_values, value_refusal

PROGRAM = "python -m executor"


def build_parser() -> argparse.ArgumentParser:
    """The executor's flags (``pipesim run``'s, less what only run does), with the flags
    and values of the other commands it lacks parsed so that they can be refused by name."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    flags = sorted(add_refused_flags(parser, REFUSED_FLAGS))
    values = admit_refused_values(parser, SIMULATOR_CHOICES)
    parser.epilog = (f"Flags of pipesim simulate, plan and run that the executor does not take, and values only the "
                     f"simulator takes, are refused in one line: {', '.join(flags + values)}.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        refused = flag_refusal(args, PROGRAM, "the executor") or value_refusal(args, PROGRAM, "the executor")
        if refused:
            raise ConfigError(refused)
        config = config_from_args(args)
    except ConfigError as error:
        if rank == 0:  # every rank torchrun started refuses alike; one line says why
            print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    from executor.launch import validate_schedule  # noqa: PLC0415 - torch loads only once flags are good
    from executor.report import summary, summary_lines, write_outputs  # noqa: PLC0415
    from executor.worker import run_worker  # noqa: PLC0415

    validate_schedule(config)
    (result,) = run_worker([config])
    if rank == 0:
        document = summary(result)
        write_outputs(result, args.json, args.trace, document)
        print("\n".join(summary_lines(result, document)))
    return 0


if __name__ == "__main__":
    # ``record`` writes the error file torchrun reads, so its summary names the failing
    # rank's own error (rank and action) rather than a bare exit code.
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
