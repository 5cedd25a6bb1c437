"""Per-rank entry point for users who start the ranks themselves with torchrun::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m executor \\
        --schedule 1f1b --pp 16 --microbatches 64 --model gpt --layers 32

Every rank runs the same command; rank 0 prints the summary and writes ``--json`` and
``--trace``.
"""

from __future__ import annotations

import argparse
import os
import sys

from executor.options import add_run_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor", description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    rank = int(os.environ.get("RANK", "0"))
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
