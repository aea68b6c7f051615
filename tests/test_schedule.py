from tierstore._schedule import LaterUses, PrefetchPolicy, unit_victim_order


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
    p = PrefetchPolicy(depth=8, max_bytes=8, unit_bytes={"a": 6, "b": 6, "c": 3, "d": 1})
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


def test_last_use_distance():
    p = PrefetchPolicy(depth=1)
    run_step(p, "abcba")
    p.start_step()
    p.on_use("a")
    assert p.next_use_distance("a") == 0  # being fetched for use now
    assert p.last_use_distance("b") == 3  # its backward use, not its next one
    assert p.next_use_distance("b") == 1
    assert p.last_use_distance("a") == 4
    for g in "bcb":
        p.on_use(g)
    assert p.last_use_distance("c") == float("inf")
    assert p.next_use_distance("b") == 0 and p.next_use_distance("a") == 1


def test_victim_order_weighs_optimizer_uses():
    p = PrefetchPolicy(depth=1)
    run_step(p, "abccba")
    p.start_step()
    for g in "abccb":  # backward has used c and is fetching b; a is next
        p.on_use(g)
    key_group = {"param/a": ("a",), "param/b": ("b",), "param/c": ("c",)}
    later = LaterUses(after={"adam/a": "param/a", "adam/b": "param/b", "adam/c": "param/c"})
    queue = {"param/c": 0, "adam/c": 0}  # c's gradient is complete and waits for its update
    order = unit_victim_order(p, key_group, later, waiting=lambda: queue)
    keys = ["param/a", "param/b", "param/c", "adam/a", "adam/b", "adam/c", "adam/stale"]
    # never used again first; then farthest first: a's state after a's last use, a, b's state, b, c's queue
    assert order(None, keys) == ["adam/stale", "adam/a", "param/a", "adam/b", "param/b", "param/c", "adam/c"]
    queue.clear()  # stepped: c and its state are not needed again this step
    assert order(None, keys)[:3] == ["param/c", "adam/c", "adam/stale"]


def test_victim_order_ranks_updates_queued_into_the_next_forward_by_the_queue():
    """Updates streamed into the next forward read their state while it runs: a queued key is ranked by its place
    in the queue, not by its parameter's backward to come (ranked so, the reads ahead went first)."""
    p = PrefetchPolicy(depth=1)
    run_step(p, "abccba")
    p.start_step()
    p.on_use("a")  # the next step's forward has reached a; the last step's updates of b and c are queued
    key_group = {"param/a": ("a",), "param/b": ("b",), "param/c": ("c",)}
    later = LaterUses(after={"adam/a": "param/a", "adam/b": "param/b", "adam/c": "param/c"},
                      grads={"grad/b": "param/b", "grad/c": "param/c"})
    queue = {"adam/b": 0, "grad/b": 0, "adam/c": 1, "grad/c": 1}
    order = unit_victim_order(p, key_group, later, waiting=lambda: queue)
    keys = ["adam/a", "param/b", "param/c", "adam/b", "grad/b", "adam/c", "grad/c"]
    # a's state waits for a's backward (5.5 uses away); c is 2 uses away, b 1; c's queued update runs 1 update
    # away, b's now: all before any backward
    assert order(None, keys) == ["adam/a", "param/c", "param/b", "adam/c", "grad/c", "adam/b", "grad/b"]
    queue.clear()  # the queue ran: the state is next used after the backward
    assert order(None, keys)[-2:] == ["param/c", "param/b"]


def test_victim_order_takes_the_nearest_use_of_a_shared_key():
    p = PrefetchPolicy(depth=1)
    run_step(p, "abcd")
    p.start_step()
    p.on_use("a")
    # "param/t" is read by a (now) and d; "param/x" only by c: a shared key counts from its nearest use.
    order = unit_victim_order(p, {"param/t": ("d", "b"), "param/x": ("c",), "param/y": ("d",)})
    assert order(None, ["param/t", "param/x", "param/y"]) == ["param/y", "param/x", "param/t"]


def test_the_trace_keeps_where_its_backward_starts():
    p = PrefetchPolicy(depth=1)
    p.start_step()
    for use in "ab":
        p.on_use(use)
    for use in "ba":
        p.backward_starts()  # each backward use says so; the first counts
        p.on_use(use)
    p.start_step()
    assert p.trace == list("abba") and p.forward_uses == 2
    run_step(p, "abc")  # departs from the trace (an evaluation forward: no backward) and records it
    p.start_step()
    assert p.trace == list("abc") and p.forward_uses is None
