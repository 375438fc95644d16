"""What one transfer posts, decided before NIXL sees it: the checked row pairs and, where
they run adjacent on both sides, one descriptor per run::

    local_idx  [3 4 5 9]    remote_idx [8 9 10 2]     (d3..d5 and r8..r10 touch end to start)
      -> by index:  4 prepared descriptors picked      (make_prepped_xfer)
      -> by runs:   [d3+d4+d5, d9] <- [r8+r9+r10, r2]  (2 descriptors, lists built per post)

``MergeRuns`` (``kvbridge.connector.transfer.nixl_config``) picks between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.connector.transfer.errors import DescriptorError
from kvbridge.connector.transfer.nixl_config import MergeRuns
from kvbridge.connector.transfer.transport import DescList, check_indices
from kvbridge.layouts.runs import merge_rows, run_lengths, run_starts


@dataclass(frozen=True, eq=False)
class XferRows:
    """One transfer's checked rows; ``runs`` holds (local, remote) Nx3 arrays with one
    descriptor per run when the transfer posts by runs, None when it posts by index."""

    local_idx: np.ndarray  # int32, what make_prepped_xfer takes
    remote_idx: np.ndarray
    num_bytes: int
    runs: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.local_idx)

    @property
    def num_descs(self) -> int:
        """Descriptors this transfer hands to NIXL."""
        return self.num_rows if self.runs is None else len(self.runs[0])


def xfer_rows(
    local: DescList,
    local_idx: np.ndarray,
    remote: DescList,
    remote_idx: np.ndarray,
    merge: MergeRuns,
    what: str,
) -> XferRows:
    """Check the pairing ``local[local_idx[k]] <-> remote[remote_idx[k]]`` and choose how
    to post it. Raises ``DescriptorError`` for unequal, empty or out-of-bounds index arrays
    and for paired descriptors of different lengths."""
    li = check_indices(local_idx, local.num_descs, f"{what}: local_idx")
    ri = check_indices(remote_idx, remote.num_descs, f"{what}: remote_idx")
    if len(li) != len(ri):
        raise DescriptorError(f"{what}: {len(li)} local indices but {len(ri)} remote ones")
    local_lens, remote_lens = local.lens[li], remote.lens[ri]
    bad = np.flatnonzero(local_lens != remote_lens)
    if len(bad):
        k = bad[0]
        raise DescriptorError(
            f"{what}: position {k}: local desc {li[k]} has {local_lens[k]} bytes, "
            f"remote desc {ri[k]} has {remote_lens[k]}"
        )
    num_bytes = int(local_lens.sum())
    if merge is MergeRuns.OFF or len(li) < 2:
        return XferRows(li, ri, num_bytes)
    starts = run_starts(li, local.adjacent, ri, remote.adjacent)
    if len(starts) == len(li):  # nothing adjacent: the prepared lists post as many
        return XferRows(li, ri, num_bytes)
    lens = run_lengths(local_lens, starts)  # the remote runs have the same lengths
    runs = (merge_rows(local.table, li, starts, lens), merge_rows(remote.table, ri, starts, lens))
    return XferRows(li, ri, num_bytes, runs)
