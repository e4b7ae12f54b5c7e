"""How much memory a node declares when nobody said (--memory-gb), with other nodes on its host.

Every node on a host used to declare all of the host's available RAM, so three nodes on one
box offered it three times over. Now each node records its *claim* in a small file per
process (``$TMPDIR/meshnet-claims-UID/PID.json``), and a node starting later offers what is
available minus what the others have claimed but not yet taken (claim minus their resident
memory: what they already hold is no longer "available" anyway). Once a node knows its layer
range, its claim shrinks to what that range needs (weights + KV budget + margin). Files of
dead processes are ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

GIB = 1024**3


def default_claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"meshnet-claims-{os.getuid()}"


@dataclass(frozen=True)
class Offer:
    """What a node offers the tracker, and what that figure came from (for the log)."""

    bytes: int
    available: int  # the host's available memory when it was computed
    others_bytes: int  # claimed by other meshnet nodes on this host and not yet resident
    others: int  # how many such nodes
    explicit: bool  # --memory-gb

    def describe(self) -> str:
        if self.explicit:
            return f"{self.bytes / GIB:.2f} GiB (--memory-gb)"
        if not self.others:
            return (
                f"{self.bytes / GIB:.2f} GiB: what is available on this host (no other meshnet "
                "node here claims memory; --memory-gb sets it)"
            )
        plural = "s" if self.others > 1 else ""
        return (
            f"{self.bytes / GIB:.2f} GiB: {self.available / GIB:.2f} GiB available on this host, "
            f"less {self.others_bytes / GIB:.2f} GiB claimed by {self.others} other meshnet "
            f"node{plural} here (--memory-gb sets it)"
        )


class HostClaims:
    """This process's memory claim, and the claims of the other meshnet nodes on the host."""

    def __init__(self, folder: Path | None = None, *, pid: int | None = None) -> None:
        self.folder = folder or default_claims_dir()
        self.pid = pid or os.getpid()

    @property
    def path(self) -> Path:
        return self.folder / f"{self.pid}.json"

    def others(self) -> tuple[int, int]:
        """(bytes claimed by other live nodes beyond what they hold resident, their count)."""
        total = count = 0
        if not self.folder.is_dir():
            return 0, 0
        for path in self.folder.glob("*.json"):
            try:
                pid = int(path.stem)
            except ValueError:
                continue
            if pid == self.pid:
                continue
            try:
                claimed = int(json.loads(path.read_text())["bytes"])
                rss = psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                with contextlib.suppress(OSError):
                    path.unlink()  # a node that died without cleaning up
                continue
            except (OSError, ValueError, KeyError, TypeError, psutil.Error):
                continue
            total += max(0, claimed - rss)
            count += 1
        return total, count

    def offer(self, memory_gb: float | None) -> Offer:
        """What to offer: --memory-gb, else available memory less the others' claims."""
        available = int(psutil.virtual_memory().available)
        if memory_gb is not None:
            return Offer(int(memory_gb * GIB), available, 0, 0, explicit=True)
        others_bytes, others = self.others()
        return Offer(max(0, available - others_bytes), available, others_bytes, others, False)

    def claim(self, nbytes: int) -> None:
        """Record this node's claim (atomically: readers never see half a file)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"bytes": int(nbytes)}))
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only tmp: nodes then just do not see each other
            logger.debug("cannot record the memory claim in %s: %s", self.folder, exc)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
