"""The placement policy (tierstore/_placement.py): pure functions over traces, no torch module or file."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._placement import (
    ROOM_SHARE,
    StepTrace,
    choose_depth,
    layered_trace,
    lower_bound_bytes,
    moved_bytes,
    plan_placement,
    predicted_stall,
    room_bytes,
)


def layered(layers: int, weight: int, state: int) -> StepTrace:
    """Layers used in forward, then backward in reverse, each update (its weight, m and v) after its backward."""
    return layered_trace(layers, weight_bytes=weight, state_bytes={"m": state, "v": state})


def test_a_streamed_key_costs_a_read_per_use_its_copy_does_not_survive_and_a_write_when_changed():
    t = layered(4, weight=100, state=100)
    everything = frozenset(t.nbytes)
    one = moved_bytes(t, everything, 300)  # room for one update: a weight and its two moments
    assert one["w1"] == 300  # read for forward, again for backward (far apart), written after its update
    assert one["mw1"] == 200  # read once, written once
    # The last layer's forward and backward are adjacent, and so are the first layer's update (the end of
    # backward) and its next forward: each is read once.
    assert one["w3"] == one["w0"] == 200
    assert moved_bytes(t, everything, 99)["w3"] == 400  # no room even for itself: read at every use
    assert set(moved_bytes(t, everything, 10**6).values()) == {0}  # everything fits: nothing leaves, nothing moves


def test_weights_used_far_apart_are_kept_before_state_and_the_prediction_meets_the_bound():
    t = layered(4, weight=100, state=100)
    # 1200 bytes of state; a budget of the 400 bytes of weights and no room keeps every weight: only state moves.
    p = plan_placement(t, budget_bytes=400, room_bytes=0)
    assert p.resident == {"w0", "w1", "w2", "w3"}
    assert p.bytes_per_step == 8 * 200 == p.lower_bound_bytes == 2 * (1200 - 400)
    assert p.resident_by_kind == {"weights": 400} and p.moved_by_kind == {"m": 800, "v": 800}
    after = layered_trace(4, weight_bytes=100, state_bytes={"m": 100}, optimizer_in_backward=False)
    assert after.events[-4:] == (("w0", "mw0"), ("w1", "mw1"), ("w2", "mw2"), ("w3", "mw3"))
    # Room for one update: the two weights read twice a step are kept first (3 bytes a byte), then keys that
    # cost 2; the step moves the bound plus twice the room.
    p = plan_placement(t, budget_bytes=700, room_bytes=300)
    assert {"w1", "w2"} < p.resident and len(p.resident) == 4
    assert p.bytes_per_step == p.lower_bound_bytes + 2 * 300 == 1600
    assert "lower bound" in p.summary() and "predicted step" in p.summary(1.0, 1e9)


def test_a_key_written_home_all_the_same_saves_its_reads_less_that_write():
    """See [Note: Written home all the same]: a changed key that speculated updates write home each step costs
    that write kept resident, and the fill keeps what saves the most."""
    t = layered(4, weight=100, state=100)
    groups = [frozenset({f"w{i}", f"mw{i}", f"vw{i}"}) for i in range(4)]  # what each update changes
    spec = dataclasses.replace(t, written={k: g for g in groups for k in g})
    everything = frozenset(t.nbytes)
    assert set(moved_bytes(spec, everything, 10**6).values()) == {100}  # nothing leaves, everything is written
    assert moved_bytes(spec, everything, 300) == moved_bytes(t, everything, 300)  # what streams is written anyway
    assert moved_bytes(spec, frozenset(), 0) == {}  # every update's keys all kept: none is speculated
    moments = frozenset(k for k in t.nbytes if not k.startswith("w"))
    assert moved_bytes(spec, moments, 10**6) == {k: 100 for k in t.nbytes}  # a weight kept is written all the same
    # The weights used far apart save 2 bytes a byte (3 before), the rest 1 (2 before): those two go first, and
    # each of the four keys kept is written home: 400 bytes more than without. The bound counts no write home.
    p = plan_placement(spec, budget_bytes=400, room_bytes=0)
    assert {"w1", "w2"} < p.resident and len(p.resident) == 4
    assert p.bytes_per_step == plan_placement(t, budget_bytes=400, room_bytes=0).bytes_per_step + 400 == 2000
    assert p.lower_bound_bytes == lower_bound_bytes(t, 400) == 1600
    assert sum(p.moved_by_kind.values()) == p.bytes_per_step and p.moved_by_kind["weights"] >= 200
    # Keys whose group is all kept are not written (their update is not speculated); the others are.
    assert moved_bytes(spec, everything - groups[1], 10**6) == {k: 100 for k in everything - groups[1]}
    # A key that saves nothing kept is not kept: with room for everything, nothing is.
    assert not plan_placement(spec, budget_bytes=10**6, room_bytes=10**6 - 100).resident
    with pytest.raises(ValueError, match="written keys \\['x'\\] have no size"):
        StepTrace(events=t.events, nbytes=t.nbytes, written={"x": frozenset({"x"})})


def test_the_step_is_predicted_as_its_forward_then_the_rest():
    """See [Note: The predicted step]: the forward bound by its compute or its reads, then the rest by its
    compute or the rest of the bytes; without a known forward, the single bound."""
    t = layered(4, weight=100, state=100)
    assert t.forward_events == 4
    p = plan_placement(t, budget_bytes=300, room_bytes=300)  # everything streams through room for one update
    # Read in the forward: w1, w2 (far from their last use) and w3 (kept from its forward to its backward, the
    # next event); w0 comes to the forward straight from its update at the end of the last step's backward.
    assert not p.resident and p.forward_bytes == 300 and p.bytes_per_step == 2 * 1200 + 2 * 100
    assert p.predicted_step_seconds(10.0, 100.0, 4.0) == max(4.0, 3.0) + max(6.0, 2300 / 100)
    assert p.predicted_step_seconds(10.0, 100.0) == max(10.0, 2600 / 100)  # the forward's share not given
    assert p.predicted_step_seconds(100.0, 100.0, 40.0) == 100.0  # compute-bound either way
    assert "forward: compute 4.000 s, reads 300 B" in p.summary(10.0, 100.0, 4.0)
    unknown = StepTrace(events=t.events, nbytes=t.nbytes, changed=t.changed)
    q = plan_placement(unknown, budget_bytes=300, room_bytes=300)
    assert q.forward_bytes is None and q.bytes_per_step == p.bytes_per_step
    assert q.predicted_step_seconds(10.0, 100.0, 4.0) == max(10.0, 2600 / 100)
    with pytest.raises(ValueError, match="forward_events=13 must be within the 12 events"):
        StepTrace(events=t.events, nbytes=t.nbytes, forward_events=13)


def test_frozen_keys_are_kept_last_and_never_written():
    t = StepTrace(events=(("a",), ("b",), ("a",), ("b",)), nbytes={"a": 10, "b": 10}, changed=frozenset({"a"}))
    assert moved_bytes(t, frozenset({"a", "b"}), 0) == {"a": 30, "b": 20}
    assert plan_placement(t, budget_bytes=10, room_bytes=0).resident == {"a"}
    assert lower_bound_bytes(t, 10) == 10  # b read once; a kept


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no size"):
        StepTrace(events=(("a",),), nbytes={})
    with pytest.raises(ValueError, match=">= 0"):
        plan_placement(layered(1, 1, 1), budget_bytes=-1, room_bytes=0)
    with pytest.raises(ValueError, match="one entry per use"):
        choose_depth([1.0], [], max_depth=4)


@st.composite
def traces(draw):
    keys = [f"k{i}" for i in range(draw(st.integers(1, 12)))]
    events = draw(st.lists(st.lists(st.sampled_from(keys), min_size=0, max_size=4).map(tuple), max_size=30))
    sizes = {k: draw(st.integers(0, 5000)) for k in keys}
    changed = frozenset(k for k in keys if draw(st.booleans()))
    ordered = sorted(changed)
    groups = [frozenset(ordered[i:i + 2]) for i in range(0, len(ordered), 2)]  # what a speculated update changes
    written = {k: g for g in groups for k in g if draw(st.booleans())}
    return StepTrace(events=tuple(events), nbytes=sizes, changed=changed, written=written)


@settings(max_examples=300, deadline=None)
@given(traces(), st.integers(0, 40000), st.integers(0, 40000))
def test_the_plan_never_exceeds_the_budget_and_never_beats_the_bound(trace, budget, room):
    p = plan_placement(trace, budget_bytes=budget, room_bytes=room)
    used = set(trace.uses())
    assert p.resident <= used
    assert p.resident_bytes == sum(trace.nbytes[k] for k in p.resident) <= max(0, budget - room)
    assert 0 <= p.lower_bound_bytes <= p.bytes_per_step
    # Keeping keys never costs bytes: the plan moves no more than streaming everything would.
    assert p.bytes_per_step <= sum(moved_bytes(trace, frozenset(used), min(room, budget)).values())
    # A bigger budget never raises the bound.
    assert lower_bound_bytes(trace, budget + 1000) <= p.lower_bound_bytes


def test_the_room_is_two_units_two_updates_and_the_backlog_or_a_share_of_the_budget():
    assert room_bytes(1000, largest_unit_bytes=10, largest_update_bytes=10) == int(1000 * ROOM_SHARE)
    assert room_bytes(1000, largest_unit_bytes=200, largest_update_bytes=100) == 600
    assert room_bytes(1000, largest_unit_bytes=400, largest_update_bytes=400) == 1000
    # Parameters waiting for updates behind backward take room beside them.
    assert room_bytes(1000, largest_unit_bytes=200, largest_update_bytes=100, behind_bytes=250) == 850
    assert room_bytes(1000, largest_unit_bytes=10, largest_update_bytes=10, behind_bytes=100) == int(1000 * ROOM_SHARE)
    assert room_bytes(1000, largest_unit_bytes=10, largest_update_bytes=10, behind_bytes=250) == 290


def test_depth_is_the_least_that_hides_what_any_depth_can_hide():
    compute = [1.0] * 8
    assert choose_depth([0.0] * 8, compute, max_depth=8) == 1  # nothing to read
    assert choose_depth([0.5] * 8, compute, max_depth=8) == 1  # a read takes half a use's compute
    assert choose_depth([0.0, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0], compute, max_depth=8) == 3  # one big read
    # The drive is the bottleneck: reading further ahead hides nothing more; one read queued behind another.
    assert choose_depth([2.0] * 8, compute, max_depth=6) == 2
    assert choose_depth([2.0] * 8, compute, max_depth=1) == 1
    # The first uses wait for their reads at every depth (nothing was read ahead of the step): that is no
    # reason to read as far ahead as allowed (see [Note: Not as deep as the room allows]).
    reads = [3.0, 3.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert len({predicted_stall(reads, compute, d) for d in range(1, 9)}) == 1  # 5 s at every depth
    assert choose_depth(reads, compute, max_depth=8) == 2


def test_predicted_stall_serves_reads_in_order_as_they_are_issued():
    compute = [1.0, 1.0, 1.0]
    # depth 1: use 0 waits 2 s for its read; use 1's read, issued as use 0 starts (at 2), is done at 3 = ready.
    assert predicted_stall([2.0, 1.0, 0.0], compute, 1) == 2.0
    # use 1's read is issued at once with depth 2, behind use 0's: done at 3, ready at 3.
    assert predicted_stall([2.0, 1.0, 0.0], compute, 2) == 2.0
    # a read longer than the compute before it: use 1 ready at 1, its read (issued at 0, behind nothing) at 3.
    assert predicted_stall([0.0, 3.0, 0.0], compute, 1) == 2.0
    assert predicted_stall([0.0, 3.0, 0.0], compute, 2) == 2.0  # issued at the step's start either way


def test_a_transient_key_moves_only_when_the_room_between_its_uses_is_too_small():
    """A gradient (made by its backward use, read by its update, never carried to the next step) is never kept,
    reads nothing at its first use, and costs a write and a read when what is used between its two uses leaves it
    no room (see [Note: Transient keys])."""
    from tierstore._placement import StepTrace, lower_bound_bytes, moved_bytes, plan_placement

    trace = StepTrace(events=(("w",), ("w", "g"), ("x",), ("y",), ("m", "g")),
                      nbytes={"w": 10, "g": 10, "x": 30, "y": 30, "m": 10}, changed=frozenset({"m", "g"}),
                      transient=frozenset({"g"}))
    assert moved_bytes(trace, frozenset({"x", "y"}), room_bytes=100)["g"] == 0  # 30 + 30 + 10 + 10 fit beside it
    assert moved_bytes(trace, frozenset({"x", "y"}), room_bytes=50)["g"] == 20  # written and read back
    assert "g" not in plan_placement(trace, budget_bytes=200, room_bytes=50).resident  # never kept, even with room
    tight = plan_placement(trace, budget_bytes=60, room_bytes=50)  # x and y stream: g goes to the drive and back
    assert "g" not in tight.resident and tight.bytes_per_step >= 20 + moved_bytes(trace, frozenset({"x", "y"}),
                                                                                  room_bytes=50)["x"]
    assert lower_bound_bytes(trace, 0) == lower_bound_bytes(
        StepTrace(events=(("w",), ("w",), ("x",), ("y",), ("m",)), nbytes={"w": 10, "x": 30, "y": 30, "m": 10},
                  changed=frozenset({"m"})), 0)
    # Kept until its last use and not read there (a speculated update's gradient): a spill is a write alone.
    kept = dataclasses.replace(trace, kept_last=frozenset({"g"}))
    assert moved_bytes(kept, frozenset({"x", "y"}), room_bytes=50)["g"] == 10
    assert moved_bytes(kept, frozenset({"x", "y"}), room_bytes=100)["g"] == 0
    # Made, read by its update, kept: spilled before the update, it is read back and its copy on the drive is
    # current, so the spill before the step moves nothing more.
    both = StepTrace(events=(("w", "g"), ("x",), ("m", "g"), ("y",), ("g",)),
                     nbytes={"w": 10, "g": 10, "x": 30, "y": 30, "m": 10}, changed=frozenset({"m", "g"}),
                     transient=frozenset({"g"}), kept_last=frozenset({"g"}))
    assert moved_bytes(both, frozenset({"x", "y"}), room_bytes=30)["g"] == 20  # written, read back: no more
    assert moved_bytes(dataclasses.replace(both, kept_last=frozenset()), frozenset({"x", "y"}), 30)["g"] == 40
    with pytest.raises(ValueError, match="kept_last keys \\['x'\\] are not transient"):
        dataclasses.replace(trace, kept_last=frozenset({"x"}))
