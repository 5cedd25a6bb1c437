"""The README's and docs' quoted outputs and pictures, regenerated from the code by one
script, so what they show is what the commands print now.

    python scripts/docs_outputs.py            # rewrite every quoted block; render the pictures
    python scripts/docs_outputs.py --check    # exit 1, naming each block that differs
    python scripts/docs_outputs.py --fast     # only the blocks of commands that take seconds

A quoted block is the fenced block right after the ```bash block that holds its command;
it keeps the lines ``keep`` selects, in order (each the next output line starting with
that text), with ``...`` where lines are left out. Pictures are the plotly pages the
commands write, rendered to PNG with kaleido where it is installed; where it is not, the
script says so and leaves the PNGs as they are (their numbers are then the blocks').
``tests/test_docs_outputs.py`` runs ``--check --fast`` in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
ELIDED = "..."


@dataclass(frozen=True)
class Quoted:
    """One quoted output: the file, the command as the file writes it (``pipesim`` and
    its flags, continuation lines joined), the lines kept, and whether it takes minutes."""

    path: str
    command: str
    keep: tuple[str, ...]
    slow: bool = False


QUOTED = (
    Quoted("README.md",
           "pipesim simulate --model mixtral-8x7b --seq-len 4096 --schedule dualpipev --pp 4 -m 16 --tp 2 "
           "--sequence-parallel --dp 8 --ep 8 --zero 1 --topology ib --nodes 8",
           ("dualpipev:", "  step time", "  bubble fraction", ELIDED, "  rank        busy", "     0 ", ELIDED,
            "  rank    ", "     0 ", ELIDED, "  model ")),
    Quoted("README.md",
           "pipesim plan --model llama3-70b --gpus 1024 --global-batch 1024 --seq-len 4096 "
           "--topology ib --gpu h100 --top 10 --json plan.json --csv plan.csv --html plan.html",
           ("  #  layout", "  1 ", "  2 ", "  3 ", ELIDED, " 10 ", "considered", "screened", "ruled out",
            "rejected before", ELIDED), slow=True),
    Quoted("README.md",
           "pipesim plan --model mixtral-8x7b --gpus 64 --global-batch 256 --seq-len 4096 --topology ib --gpu h100 "
           "--top 5",
           ("  #  layout", "  1 ", "  2 ", "  3 ", "  4 ", "  5 ", "considered", "screened", ELIDED), slow=True),
    Quoted("README.md",
           "pipesim plan --model mixtral-8x7b --gpus 64 --global-batch 256 --seq-len 4096 --topology ib --gpu h100 "
           "--top 4 --schedules interleaved-1f1b --constraint pp=2 --constraint ep=8 --constraint zero=1 "
           "--constraint recompute=none",
           ("  #  layout", "  1 ", "  2 ", "  3 ", "  4 ")),
    Quoted("docs/cluster-model.md", "pipesim simulate --model llama3-8b --schedule 1f1b --pp 2 -m 8 --gpu h100",
           ("  step time",)),
    Quoted("docs/cluster-model.md",
           "pipesim simulate --model llama3-8b --pp 4 -m 16 --schedule zbv --gpu h100 --topology nvlink",
           ("  step time",)),
    Quoted("docs/cluster-model.md",
           "pipesim simulate --model llama3-8b --pp 4 -m 16 --schedule zbv --gpu h100 --topology nvlink "
           "--layers-per-stage 4,4,4,5,5,4,4,2", ("  step time",)),
    Quoted("docs/cluster-model.md",
           "pipesim simulate --model llama3-8b --schedule 1f1b --pp 2 -m 8 --gpu h100 --cross-entropy te",
           ("  step time",)),
    Quoted("docs/plan.md",
           "pipesim plan --model mixtral-8x7b --gpus 16 --global-batch 64 --recompute-moe-act off,on --top 3",
           ("  #  layout", "  1 ", "  2 ", "  3 ")),
    Quoted("docs/plan.md",
           "pipesim plan --model mixtral-8x7b --gpus 16 --global-batch 64 --top 1",
           ("  #  layout", "  1 ")),
    Quoted("docs/plan.md",
           "pipesim simulate --model mixtral-8x7b --schedule zbv -v 2 --pp 2 --tp 2 --dp 4 --ep 8 --etp 1 "
           "--microbatch-size 1 -m 16 --zero 1 --sequence-parallel --topology ib --nodes 2 --gpu h100",
           ("zbv:", "  step time", ELIDED, "  warning: rank 0")),
    Quoted("docs/interop.md",
           "pipesim plan --model mixtral-8x7b --gpus 16 --global-batch 32 --seq-len 4096 --gpu h100 --schedules 1f1b "
           "--microbatch-sizes 1 --constraint pp=2 --constraint tp=2 --ep 2,4 --recompute none,full --quiet "
           "--torchtitan titan-moe --fsdp",
           ("torchtitan shards", "wrote ")),
    Quoted("docs/schedules.md",
           "pipesim sweep --model llama3-8b --pp 4 --schedule zb-auto,zbv-auto,1f1b,zb-h1,zbv -m 16 --gpu h100 "
           "--topology nvlink --memory-limit 75GB",
           ("schedule", "zb-auto", "zbv-auto", "1f1b", "zb-h1", "zbv")),
)

# pictures: the file, the command that writes the page (into {out}), and the page it writes
PICTURES = (
    ("docs/img/demo-gantt.png", "pipesim demo --out {out}", "gantt-all.html"),
    ("docs/img/plan-llama3-70b.png", "pipesim plan --model llama3-70b --gpus 1024 --global-batch 1024 --seq-len 4096 "
                                     "--topology ib --gpu h100 --top 10 --html {out}/plan.html", "plan.html"),
)


def commands_in(block: str) -> str:
    """A ```bash block's text with continuation lines joined and spaces collapsed."""
    return " ".join(block.replace("\\\n", " ").split())


def output_of(command: str, folder: Path) -> str:
    """What ``command`` (``pipesim ...``) prints on stdout, run in ``folder`` (where its
    files go)."""
    from pipesim.cli import main

    argv = shlex.split(command)[1:]
    buffer = io.StringIO()
    cwd = Path.cwd()
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            status = main(argv)
    finally:
        os.chdir(cwd)
    if status not in (0, 3):
        raise RuntimeError(f"{command}: exit status {status}")
    return buffer.getvalue()


def excerpt(output: str, keep: tuple[str, ...]) -> str:
    """The lines of ``output`` that ``keep`` selects (see the module), ``...`` between."""
    lines = output.splitlines()
    chosen, at = [], 0
    for prefix in keep:
        if prefix == ELIDED:
            chosen.append(ELIDED if not chosen or not chosen[-1].startswith(" ") else "  " + ELIDED)
            continue
        found = next((index for index in range(at, len(lines)) if lines[index].startswith(prefix)), None)
        if found is None:
            raise RuntimeError(f"no output line starting {prefix!r} after line {at}")
        chosen.append(lines[found])
        at = found + 1
    return "\n".join(chosen) + "\n"


def quoted_block(text: str, command: str) -> tuple[int, int, str]:
    """Where the output block after ``command``'s bash block lies in ``text``: its body's
    start and end offsets and the body."""
    fences = list(FENCE.finditer(text))
    for fence, following in zip(fences, fences[1:], strict=False):
        if fence.group(1) == "bash" and commands_in(fence.group(2)) == command and following.group(1) == "":
            return following.start(2), following.end(2), following.group(2)
    raise RuntimeError(f"no quoted output after a bash block of: {command}")


def regenerate(quoted: list[Quoted], check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) each quoted block; the ones that differed."""
    differing = []
    with tempfile.TemporaryDirectory() as folder:
        for entry in quoted:
            path = ROOT / entry.path
            text = path.read_text(encoding="utf-8")
            start, end, body = quoted_block(text, entry.command)
            fresh = excerpt(output_of(entry.command, Path(folder)), entry.keep)
            if fresh != body:
                differing.append(f"{entry.path}: the output of `{entry.command}` differs:\n--- quoted\n{body}"
                                 f"+++ printed now\n{fresh}")
                if not check:
                    path.write_text(text[:start] + fresh + text[end:], encoding="utf-8")
    return differing


def render_pictures() -> str:
    """Render each picture's page to its PNG with kaleido, or say why not."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return ("no renderer: kaleido is not installed, so the PNGs are left as they are "
                f"({', '.join(picture for picture, _, _ in PICTURES)}); the quoted numbers were regenerated")
    import plotly.io as pio

    with tempfile.TemporaryDirectory() as folder:
        for picture, command, page in PICTURES:
            output_of(command.format(out=folder), Path(folder))
            figure = _first_figure(Path(folder) / page)
            pio.write_image(figure, str(ROOT / picture), width=1400, height=900)
    return f"rendered {', '.join(picture for picture, _, _ in PICTURES)}"


def _first_figure(page: Path) -> dict:
    """The first plotly figure of a written page (its data and layout)."""
    import json

    text = page.read_text(encoding="utf-8")
    call = text.index("Plotly.newPlot(")
    decoder = json.JSONDecoder()
    rest = text[text.index(",", call) + 1:].lstrip()
    data, used = decoder.raw_decode(rest)
    layout, _ = decoder.raw_decode(rest[used:].lstrip(", \n"))
    return {"data": data, "layout": layout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 naming the blocks that differ")
    parser.add_argument("--fast", action="store_true", help="only the blocks of commands that take seconds")
    args = parser.parse_args(argv)
    chosen = [entry for entry in QUOTED if not (args.fast and entry.slow)]
    differing = regenerate(chosen, args.check)
    for difference in differing:
        print(difference)
    if args.check:
        print(f"{len(differing)} of {len(chosen)} quoted outputs differ from what the code prints")
        return 1 if differing else 0
    print(f"rewrote {len(differing)} of {len(chosen)} quoted outputs")
    if not args.fast:
        print(render_pictures())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
