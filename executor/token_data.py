"""Training text from a local file (``--data FILE``), tokenized byte by byte.

A byte-level tokenizer needs no vocabulary file and downloads nothing: token ``b`` is
byte ``b`` (0-255), and two specials mark the document's ends (``BOS``, ``EOS``), so
the vocabulary is ``BYTE_VOCAB`` = 258. The file is one document, ``BOS bytes EOS``,
repeated end to end where a step asks for more tokens than it has. Each sample is a
window of ``seq_len + 1`` tokens (inputs and next-token targets) starting at an offset
drawn from the step's generator, so the data are deterministic from ``--seed`` and the
step, as the synthetic tokens are.

The file is checked before any process starts: it must exist and be a regular,
non-empty file (a directory, a FIFO or a device is refused: reading a FIFO would block
every rank).
"""

from __future__ import annotations

import os
import stat

from executor.config import ConfigError

BOS, EOS = 256, 257
BYTE_VOCAB = 258


def check_data_file(path: str) -> None:
    """Refuse, in one line naming ``--data``, a file the run cannot read as text."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"--data {path}: no such file") from None
    except OSError as error:
        raise ConfigError(f"--data {path}: cannot read it ({error.strerror})") from None
    if stat.S_ISDIR(status.st_mode):
        raise ConfigError(f"--data {path} is a directory; give a text file")
    if not stat.S_ISREG(status.st_mode):
        raise ConfigError(f"--data {path} is not a regular file (a FIFO, socket or device); give a text file")
    if status.st_size == 0:
        raise ConfigError(f"--data {path} is empty")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"--data {path}: not readable")


def byte_tokens(path: str) -> list[int]:
    """The file as one document of byte tokens: ``BOS``, its bytes, ``EOS``."""
    with open(path, "rb") as file:
        return [BOS, *file.read(), EOS]


def token_windows(tokens, count: int, length: int, generator):
    """``count`` windows of ``length`` tokens (a ``count x length`` LongTensor), each at an
    offset drawn from ``generator`` in the document repeated end to end."""
    import torch  # noqa: PLC0415 - the config's checks above load no torch

    document = torch.tensor(tokens, dtype=torch.long)
    repeats = -(-(length + len(tokens)) // len(tokens))
    stream = document.repeat(repeats)
    offsets = torch.randint(len(tokens), (count,), generator=generator)
    return torch.stack([stream[offset:offset + length] for offset in offsets.tolist()])
