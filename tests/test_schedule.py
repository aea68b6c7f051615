from tierstore._schedule import PrefetchPolicy


def run_step(policy, uses):
    policy.start_step()
    return [policy.on_use(g) for g in uses]


def test_first_step_records_then_replays():
    p = PrefetchPolicy(depth=2)
    uses = ["a", "b", "c", "d", "c", "b", "a"]
    assert run_step(p, uses) == [[]] * 7
    got = run_step(p, uses)
    assert got[0] == ["b", "c"]
    assert got[3] == ["c", "b"]
    assert got[-1] == []
    assert p.trace == uses


def test_depth_zero_never_prefetches():
    p = PrefetchPolicy(depth=0)
    run_step(p, "abc")
    assert run_step(p, "abc") == [[], [], []]


def test_bytes_bound():
    p = PrefetchPolicy(depth=8, max_bytes=8, group_bytes={"a": 6, "b": 6, "c": 3, "d": 1})
    run_step(p, "abcd")
    assert run_step(p, "abcd")[0] == ["b"]  # b alone: b+c would be 9 > 8


def test_departure_falls_back_and_rerecords():
    p = PrefetchPolicy(depth=1)
    run_step(p, "abc")
    got = run_step(p, "axc")
    assert got == [["b"], [], []]
    assert not p.on_trace and p.departures == 1
    assert run_step(p, "axc")[0] == ["x"]  # the new trace is used from the next step


def test_belady_victim_order():
    p = PrefetchPolicy(depth=1)
    run_step(p, "abcd")
    p.start_step()
    p.on_use("a")
    assert p.victim_order(["b", "c", "d", "z"]) == ["z", "d", "c", "b"]
