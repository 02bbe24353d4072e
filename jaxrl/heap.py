"""CPython's cyclic garbage collector in a long-running jaxrl process.

Starting a `jaxrl` process (importing JAX, Flax, Orbax and gRPC; building the model; tracing and
compiling or loading every program) churns through millions of container objects and leaves
hundreds of thousands alive for the whole run. At CPython's default thresholds the youngest
generation is collected every 700 net allocations and each oldest-generation pass walks every
object alive, though the start-up ones never become garbage: about a tenth of the CPU of the
test suite's processes went to the collector. Two settings, as vLLM, SGLang and Ray Serve use
them:
- `collect_less()`, first thing in a process: the youngest generation every 50,000
  allocations instead of 700 (cycles are found as before, later; what reference counting frees
  is freed at once either way);
- `frozen_heap()`, around a serving or training loop once its start-up is done (an engine's
  programs loaded, a trainer built): one full collection, then every object still alive moves
  to the permanent generation (`gc.freeze`), so the collections the loop triggers walk only
  what it allocated since. A frozen object is still freed when its last reference goes; a cycle
  among frozen objects is found again once the loop ends (`gc.unfreeze`), so a notebook or a
  test process that runs many loops keeps nothing of the ones that ended.
"""

from __future__ import annotations

import contextlib
import gc

YOUNGEST_EVERY = 50_000      # net container allocations between youngest-generation passes
OLDER_EVERY = 20             # passes of a generation between passes of the next


def collect_less() -> None:
    """The collector's thresholds for a process that allocates heavily at start-up."""
    gc.set_threshold(YOUNGEST_EVERY, OLDER_EVERY, OLDER_EVERY)


@contextlib.contextmanager
def frozen_heap():
    """Collects once, then keeps every object alive now out of the collector's passes until
    the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
