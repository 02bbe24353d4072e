"""The RL checkpoint's resume state: saved with its layout, read back equal, read from the
unnumbered layout before it, and refused with a clear error for a layout it cannot read."""

import pytest

from jaxrl.train.checkpoint import CheckpointError
from jaxrl.trainer.resume import LAYOUT, ResumeState


def test_round_trip_and_defaults():
    state = ResumeState(position=7, rollouts=[{"a": 1}], redo=[3], partial={"4": []},
                        next_problem=12, stats={"scored": 5}, iterator={"i": 2},
                        lag_stats={"x": 1}, trained=64, time_s=9.5, eval_before=0.25)
    saved = state.to_saved()
    assert saved["layout"] == LAYOUT
    assert ResumeState.from_saved(saved) == state
    assert ResumeState.from_saved(None) == ResumeState()


def test_the_unnumbered_layout_before_is_read():
    old = {"position": 3, "rollouts": [], "redo": [], "partial": {}, "next_problem": 1,
           "stats": None, "iterator": None, "lag_stats": None, "trained": 16, "time_s": 1.0,
           "eval_before": None}
    assert ResumeState.from_saved(old).trained == 16


@pytest.mark.parametrize("data,named", [({"layout": LAYOUT + 1}, f"layout {LAYOUT + 1}"),
                                        ({"layout": LAYOUT, "shards": 2}, "['shards']")])
def test_a_layout_it_cannot_read_is_refused_by_name(data, named):
    with pytest.raises(CheckpointError, match="reads layout") as e:
        ResumeState.from_saved(data, "checkpoint 40")
    assert named in str(e.value) and "checkpoint 40" in str(e.value)
