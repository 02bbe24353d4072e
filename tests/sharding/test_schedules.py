"""Schedule tables (sharding/schedules.py): valid for every stage and microbatch count, with
the bubbles and activation memory the papers promise, checked against hand-counted tables."""

import dataclasses
from fractions import Fraction

import pytest

from sharding import schedules as sch
from sharding.schedules import B, F, R, W, X, Op

pytestmark = pytest.mark.multi_device


@pytest.mark.parametrize("name", sch.TABLE_SCHEDULES)
def test_every_table_is_valid_up_to_8_stages_and_32_microbatches(name):
    for p in (2, 3, 4, 6, 8):
        for m in (1, 2, 4, 8, 16, 32):
            if name == "interleaved" and m % p:
                continue
            sched = sch.build(name, p, m, repeats=2)   # `check` runs inside
            assert sched.peak() <= sched.bound
            assert sched.bubble() >= sched.bubble_floor() - 1e-12, (p, m)
            ops = [op for row in sched.rows for op in row if op is not None]
            assert len(ops) == len(set(ops))
            if name == "1f1b":   # PipeDream-Flush: stage 0 holds at most p microbatches
                assert sched.bound == min(p, m) or sched.peak() <= p


def test_1f1b_is_the_hand_counted_table():
    """p=2, m=3: stage 1 alternates F and X from the start; stage 0 warms up with 2 F."""
    sched = sch.build("1f1b", 2, 3)
    assert sched.render().splitlines() == [
        "stage 0: F0 F1  .  . X0  = F2 X1  =  . X2  =",
        "stage 1:  . F0 X0  = F1 X1  = F2 X2  =  .  ."]
    # 12 ticks; each stage works 3 x (1 + 2) of them.
    assert sched.bubble() == pytest.approx(1 - 2 * 3 * 3 / (2 * 12))


def test_check_catches_a_broken_table():
    sched = sch.build("zb-h1", 2, 2)
    rows = [list(r) for r in sched.rows]
    # Swap stage 1's first B and W: W before its B.
    t_b = rows[1].index(Op(B, 1, 0))
    t_w = rows[1].index(Op(W, 1, 0))
    rows[1][t_b], rows[1][t_w] = rows[1][t_w], rows[1][t_b]
    broken = dataclasses.replace(sched, rows=tuple(tuple(r) for r in rows))
    with pytest.raises(ValueError, match=r"starts before"):
        sch.check(broken)
    tight = dataclasses.replace(sched, bound=Fraction(1))
    with pytest.raises(ValueError, match=r"holds 2 stage-microbatches of activations, above "
                                         r"the bound 1"):
        sch.check(tight)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_the_schedules_trade_bubble_for_memory_as_the_papers_say(p, m):
    one_f_one_b, zb = sch.build("1f1b", p, m), sch.build("zb-h1", p, m)
    half, v_min, v_zb = sch.build("v-half", p, m), sch.build("v-min", p, m), sch.build("v-zb", p, m)
    inter = sch.build("interleaved", p, m, repeats=2)
    # ZB-H1: a smaller bubble at 1F1B's peak memory; V-ZB: smaller still, same memory.
    assert zb.bubble() < one_f_one_b.bubble() and zb.peak() == one_f_one_b.peak() == p
    assert v_zb.bubble() < zb.bubble() and v_zb.peak() <= p
    # The V schedules' memory, as the paper counts it: (p+2)//2 and (p+4)//3 stage-microbatches
    # (about a half and a third of 1F1B's), each at a smaller bubble than 1F1B's.
    assert half.peak() <= (p + 2) // 2 and v_min.peak() <= (p + 4) // 3
    assert v_min.bubble() < one_f_one_b.bubble() and half.bubble() < one_f_one_b.bubble()
    # Interleaved: a smaller bubble than 1F1B for more memory.
    assert inter.bubble() < one_f_one_b.bubble() and inter.peak() > p


def test_the_bubble_floor_is_reached_by_zb_h1_and_rules_out_a_strict_third_at_1f1b_bubble():
    """The floor (`Schedule.bubble_floor`: activation lifetimes against the memory bound) is
    tight: ZB-H1's tables reach it. It also shows why V-Min holds (p+4)//3 stage-microbatches
    and not a strict third of 1F1B's: at 4 stages no V table holding p/3 (one stage-microbatch,
    the V's chunks holding half a stage each) can idle as little as 1F1B from 8 microbatches
    on, and at 8 stages none can from 32 on; at the paper's count v-min does."""
    for p in (2, 4, 8):
        for m in (8, 16, 32):
            zb = sch.build("zb-h1", p, m)
            assert zb.bubble() == pytest.approx(zb.bubble_floor())
    for p, ms in ((4, (8, 16, 32)), (8, (32,))):
        for m in ms:
            one, v_min = sch.build("1f1b", p, m), sch.build("v-min", p, m)
            third = dataclasses.replace(v_min, bound=Fraction(2 * p // 3, 2))
            assert one.bubble() < third.bubble_floor()
            assert v_min.bubble_floor() <= v_min.bubble() < one.bubble()


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_h1_idles_a_third_of_1f1b_at_the_same_peak(p):
    """ZB-H1's claim (Qi et al. 2023) in the paper's measure: (p-1) idle ticks per stage
    against 1F1B's 3(p-1), a step of 3m+p-1 ticks, and p microbatches in flight."""
    for m in sorted({p, 8, 16, 32}):
        zb, one = sch.build("zb-h1", p, m), sch.build("1f1b", p, m)
        assert 3 * zb.idle() == one.idle() == 3 * p * (p - 1), (p, m)
        assert zb.ticks == 3 * m + p - 1
        assert zb.peak() == one.peak() == p


def test_reference_fill_keeps_each_schedule_valid_and_its_peak():
    """PipeFill's R ops: one per (chunk, microbatch) on the chunk's stage, after the previous
    chunk's R, before the head that reads the reference log-probs (`check`); each stage's own
    ops keep their order, so the activation peak is the schedule's; the fill never costs more
    than running the reference pass first on its own."""
    for name in sch.TABLE_SCHEDULES:
        for p, m in ((2, 4), (4, 8), (8, 32)):
            base = sch.build(name, p, m, repeats=2)
            filled = sch.with_reference(base)
            refs = [op for row in filled.rows for op in row if op is not None and op.kind == R]
            assert len(refs) == len(set(refs)) == base.chunks * m
            assert filled.peak() == base.peak()
            for s in range(p):
                assert [op for op in filled.rows[s] if op is not None and op.kind != R] == \
                    [op for op in base.rows[s] if op is not None]
            own_pass = base.ticks + base.chunks_per_stage * m + p - 1
            assert filled.ticks <= own_pass, (name, p, m)


def test_a_v_schedule_absorbs_part_of_the_reference_pass():
    """A V's last chunk sits on stage 0 and V-Min's bubbles leave room: at 4 stages x 8
    microbatches it absorbs a quarter of the R work (59 -> 71 ticks for 64 R ticks on 4
    stages). In 1F1B the last stage's reference chunk is in series with its ops: m more
    ticks, none absorbed."""
    v_min = sch.build("v-min", 4, 8)
    filled = sch.build("v-min", 4, 8, reference=True)
    assert (v_min.ticks, filled.ticks) == (59, 71)
    assert sch.absorbed(v_min, filled) == pytest.approx(0.25)
    one = sch.build("1f1b", 4, 8)
    one_filled = sch.build("1f1b", 4, 8, reference=True)
    assert one_filled.ticks == one.ticks + 8 and sch.absorbed(one, one_filled) == 0
    # With costs: the same fill measured in the costs' units.
    units = {"F": 1.0, "B": 1.0, "W": 1.0, "R": 1.0}
    assert sch.absorbed(v_min, filled, units) == pytest.approx(0.25)


def test_check_catches_a_reference_head_after_its_use():
    filled = sch.build("1f1b", 2, 2, reference=True)
    rows = [list(r) for r in filled.rows]
    t_r, t_f = rows[1].index(Op(R, 1, 0)), rows[1].index(Op(F, 1, 0))
    rows[1][t_r], rows[1][t_f] = rows[1][t_f], rows[1][t_r]
    broken = dataclasses.replace(filled, rows=tuple(tuple(r) for r in rows))
    with pytest.raises(ValueError, match=r"starts before"):
        sch.check(broken)


def test_weighted_bubble_with_unit_costs_is_the_tables_and_grows_with_a_slower_w():
    sched = sch.build("zb-h1", 4, 8)
    units = {"F": 1.0, "B": 1.0, "W": 1.0}
    assert sch.weighted_bubble(sched, units) <= sched.bubble() + 1e-9
    x = sch.build("1f1b", 4, 8)
    assert sch.weighted_bubble(x, units) == pytest.approx(x.bubble())
    assert sch.weighted_bubble(x, {"F": 1.0, "B": 2.0, "W": 2.0}) == pytest.approx(
        3 * 5 / (8 * 5 + 3 * 5))


def test_slots_hold_every_message_until_it_is_read():
    """The slot allocation never hands a slot to a second message while the first is unread
    (replayed tick by tick on the arrays the stage programs use)."""
    for name, reference in [(n, r) for n in sch.TABLE_SCHEDULES for r in (False, True)]:
        sched = sch.build(name, 4, 8, repeats=2, reference=reference)
        arr = sch.as_arrays(sched)
        inbox = [dict() for _ in range(4)]       # slot -> message still unread
        for t in range(sched.ticks):
            for s in range(4):
                op = arr["op"][t, s]
                reads = (op in (F, R) and not arr["first"][t, s]) or op in (B, X)
                if reads:
                    assert arr["in_slot"][t, s] in inbox[s], (name, t, s)
                    inbox[s].pop(arr["in_slot"][t, s])
            for s in range(4):
                send = arr["send"][t, s]
                if send:
                    dest = {1: (s + 1) % 4, 2: (s - 1) % 4, 3: s}[send]
                    slot = arr["send_slot"][t, s]
                    assert slot not in inbox[dest], (name, t, s)
                    inbox[dest][slot] = t
        assert all(not box for box in inbox)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_every_table_holds_at_most_the_controllable_memory_papers_activations(stages):
    """The paper's counts (table 1: 1F1B p, V-Half (p+2)//2, V-Min (p+4)//3, in
    stage-microbatches) at 4 and 8 stages are the ratios it states: V-Half 0.75x and 0.625x
    of 1F1B, V-Min 0.5x; each table's own peak stays within its schedule's count."""
    count = {name: sch.paper_activations(name, stages)
             for name in ("1f1b", "zb-h1", "v-half", "v-min", "v-zb")}
    if stages == 4:
        assert (count["v-half"] / count["1f1b"], count["v-min"] / count["1f1b"]) == (0.75, 0.5)
    if stages == 8:
        assert (count["v-half"] / count["1f1b"], count["v-min"] / count["1f1b"]) == (0.625, 0.5)
    for name, paper in count.items():
        assert sch.build(name, stages, 2 * stages).peak() <= paper, name
    assert sch.paper_activations("interleaved", stages) is None
