"""A decode dispatch's batches: which running sequences go in one batch, or two when that is
cheaper (`decode_groups`), and the batches dispatched whose tokens are not read back yet
(`InFlight`).

The engine loop dispatches step t+1 before it reads step t's tokens (the sampled tokens stay in
the device's decode state, which the next step feeds), so the host's work for one step (reading
tokens back, streaming them, the stop rules, planning and dispatching the next) runs while the
device computes the next: vLLM's and SGLang's overlapped scheduling. A sequence is then in
flight for one more step than the host knows: when step t's tokens show it ended (EOS, a stop
token, its grammar complete), step t+1 has decoded it once more, and that token is dropped. An
end by length is known before the tokens are, and such a sequence is not dispatched again
(`ends_in_flight`).
"""

from __future__ import annotations

import dataclasses

from serving.engine import Decoded
from serving.sequence import Sequence


@dataclasses.dataclass
class InFlight:
    """Decode batches dispatched and not yet read back: each batch's (slot, sequence) rows and
    its outputs on the device, the steps each ran, the weights version that ran them, and the
    tokens their rows attended over (k x the sum of their cached lengths)."""
    batches: list[tuple[list[tuple[int, Sequence]], Decoded]]
    steps: int
    version: int
    held_tokens: int


def ends_in_flight(seq: Sequence, max_len: int) -> bool:
    """`seq` ends by length once the tokens it has in flight are read back: decoding it again
    would only make tokens that are dropped."""
    s, n = seq.request.sampling, len(seq.tokens) + seq.inflight
    return seq.inflight > 0 and (n >= s.max_tokens or len(seq.request.prompt) + n >= max_len)


# A row of a decode batch costs about this many pages of attention in the rest of the model
# (projections, MLP, sampling), and a dispatch about this many row-pages of host overhead.
_ROW_PAGES, _DISPATCH_ROW_PAGES = 4, 16
_SPLIT_GAIN = 0.8     # two batches only when they cost at most this share of one


def decode_groups(cfg, owners: list[tuple[int, Sequence]], k: int, bucket=None
                  ) -> list[list[tuple[int, Sequence]]]:
    """The running (slot, sequence) pairs in one decode batch, or two when that is cheaper: the
    reference attention pads every row to the batch's longest, so in a long tail (many short
    sequences, a few long ones) the short rows go in a batch at their own width. Cost of a batch:
    its rows (bucketed: `bucket(n)`, by default the config's ladder) x (its page-table width +
    _ROW_PAGES), plus a dispatch; two batches when they cost at most _SPLIT_GAIN of one."""
    cached = [seq.cached for _, seq in owners]       # each row's, once
    order = sorted(range(len(owners)), key=cached.__getitem__)
    by_length = [owners[i] for i in order]
    widths = [cfg.table_width(cached[i] + k) for i in order]
    n, bucket, wide = len(by_length), bucket or cfg.row_bucket, widths[-1] + _ROW_PAGES
    # cost(rows, width) = bucket(rows) * (width + _ROW_PAGES) + _DISPATCH_ROW_PAGES
    best = _SPLIT_GAIN * (bucket(n) * wide + _DISPATCH_ROW_PAGES)   # split only for a clear gain
    split = None
    for i in range(n - 1, 0, -1):   # on a tie, the fewest rows at the wide width
        c = bucket(i) * (widths[i - 1] + _ROW_PAGES) + bucket(n - i) * wide
        if c + 2 * _DISPATCH_ROW_PAGES < best:
            best, split = c + 2 * _DISPATCH_ROW_PAGES, i
    return [by_length] if split is None else [by_length[:split], by_length[split:]]
