"""Progress lines for long passes over a model's experts (packing them into
host memory, reading them from a checkpoint)."""
from __future__ import annotations

__all__ = ["report_progress"]


def report_progress(progress: bool, verb: str, where: str, done: int, total: int, next_report: int) -> int:
    """Prints how far a long pass over the experts is (every GiB, on passes
    of 1 GiB or more); returns the byte count of the next report."""
    if progress and total >= (1 << 30) and (done >= next_report or done == total):
        print(f"prefetch: {verb} {done / 2**30:.1f} of {total / 2**30:.1f} GiB of experts {where}", flush=True)
        return done + (1 << 30)
    return next_report
