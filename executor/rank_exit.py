"""How a rank of a local run ends when its function fails: its error recorded for the
launcher, then the process gone at once, while its output still goes to its log.

torch's launcher points a rank's stdout and stderr at the rank's log files only while the
rank's function runs, and hands them back to the console when it returns or raises. A
failed rank then tears its interpreter down on the console's descriptors: whatever its
C++ runtime says from there (gloo's "terminate called after throwing ..." when a peer's
socket has gone, the fault handler's thread dump on the abort that follows) lands on
the user's terminal ahead of ``pipesim run``'s one-line summary. So a failed rank does
here what torch's ``record`` would (the traceback to its stderr, the structured error to
the file the launcher reads) and then leaves with ``os._exit(1)``, before the handing
back: no teardown, nothing after it. The launcher sees exit code 1 and the same error
record as before. A rank that succeeds returns as usual (its result travels back
through the launcher's queue after the function returns).

The launcher reports one failure, the first failed process it finds when it looks (every
50 ms), and a rank's error that says a peer went away is a consequence of that peer's
end. Such a rank waits ``PEER_LOSS_GRACE_SECONDS`` after recording its error, so that
the peer that died first (killed, or failed on its own) is the one the launcher finds:
without the wait, a rank killed by SIGKILL was reported as having "stopped" in some runs,
its signal lost, because its peer's exit now comes too soon after its own.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

# Errors a rank sees because a peer went away; they are consequences, not causes.
PEER_LOSS = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out",
             "Connection refused", "NCCL communicator was aborted", "recvBytes", "sendBytes")
PEER_LOSS_GRACE_SECONDS = 1.0


class ExitOnFailure:
    """``function`` for a launched rank: on an exception, ``exit_failed_rank`` (an interrupt
    or ``SystemExit`` goes on as before). A class,
    not a closure, so the spawn start method can pickle it (with ``function`` by name)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        # the launcher names the entry point by these
        self.__name__ = getattr(function, "__name__", type(self).__name__)
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        try:
            return self.function(*args)
        except Exception as error:  # noqa: BLE001 - every failure ends the rank the same way (not an interrupt)
            exit_failed_rank(error)


def exit_failed_rank(error: BaseException) -> NoReturn:
    """Print the traceback (the rank's stderr is still its log), write torch's error
    record for the launcher, flush, wait a moment if the error is a peer's loss, and end
    the process with exit code 1."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler  # noqa: PLC0415

    traceback.print_exception(error)
    get_error_handler().record_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    if any(marker in str(error) for marker in PEER_LOSS):
        time.sleep(PEER_LOSS_GRACE_SECONDS)  # the peer's own end first, for the launcher to find
    os._exit(1)
