"""The residency policy (offload_engine/store/policy.py) on its own: keys, no store, no I/O.

The same object decides for TieredStore and for the planner's replay (plan/step_sim.py), so
these rules are what both do: Belady victims by next use in the declared schedule, one
tie-break, prefetches that never evict a bucket needed sooner, demand fills that wait for
write-backs rather than evict a bucket about to be used, and credit for bytes in flight.
"""

import subprocess
import sys

import pytest

from offload_engine.store.policy import INF, Credit, ResidencyPolicy, StepSchedule, WriteBacks

FWD = ["a", "b", "c", "d", "e"]
# a reversed walk first meets "b" before "c" (say a bucket both share): not FWD reversed
BWD = ["e", "d", "b", "c", "a"]


def policy(depth=2, alternate=True, forward=FWD, backward=BWD):
    p = ResidencyPolicy(depth, alternate)
    p.declare(forward, backward)
    return p


# -- the schedule ---------------------------------------------------------------------------
def test_steps_alternate_between_the_declared_orders():
    p = policy()
    assert p.step_is_backward is False           # nothing begun yet
    assert [p.begin_step() for _ in range(4)] == [FWD, BWD, FWD, BWD]
    assert p.step_is_backward is True
    q = policy(alternate=False)
    assert [q.begin_step() for _ in range(3)] == [FWD, FWD, FWD]
    assert q.step_is_backward is False


def test_next_use_counts_from_the_cursor_into_the_next_steps_own_order():
    s = StepSchedule(FWD, BWD, alternate=True)
    assert s.next_use("a") == INF                # no step begun: nothing is known
    s.begin_step()                               # step 0: FWD
    assert [s.next_use(k) for k in FWD] == [1, 2, 3, 4, 5]
    assert s.mark_used("a") == ["a"] and s.mark_used("c") == ["b", "c"]  # b skipped
    # a, b and c are next used in step 1, at their BWD positions (4, 2, 3)
    assert s.next_use("d") == 1 and s.next_use("e") == 2
    assert s.next_use("b") == 5 - 2 + 2 and s.next_use("c") == 5 - 2 + 3
    assert s.next_use("a") == 5 - 2 + 4
    assert s.next_use("zz") == INF               # not in the schedule
    assert s.mark_used("b") == []                # behind the cursor: it stays where it is


def test_upcoming_window_runs_on_into_the_next_step():
    p = policy(depth=3)
    p.begin_step()
    assert p.upcoming() == ["a", "b", "c"]
    for k in FWD[:4]:
        p.note_use(k)
    assert p.upcoming() == ["e", "e", "d"]       # this step's last, then step 1's first two
    assert policy(depth=0).upcoming() == []


def test_orders_must_list_the_same_buckets_once():
    with pytest.raises(ValueError, match="more than once"):
        StepSchedule(["a", "a"])
    with pytest.raises(ValueError, match="same buckets"):
        StepSchedule(["a", "b"], ["a", "c"])
    assert StepSchedule(["a", "b", "c"]).backward == ["c", "b", "a"]


def test_recording_makes_the_first_steps_order_the_schedule():
    p = ResidencyPolicy(2, alternate=True)
    assert p.begin_step() is None                # step 0 is recorded
    for k in ["x", "y", "x", "z"]:
        p.note_use(k)
    assert p.begin_step() == ["z", "y", "x"]     # step 1 walks it backward
    assert p.begin_step() == ["x", "y", "z"]
    assert ResidencyPolicy(2, True).begin_step() is None


# -- victims -----------------------------------------------------------------------------------
def test_the_victim_is_the_candidate_used_furthest_in_the_future():
    p = policy()
    p.begin_step()
    p.note_use("a")
    p.note_use("b")
    for k in "abcde":
        p.offer(k, dirty=False, last_use=0)
    # c, d, e are used later in this step; a and b next step (BWD: b at 2, a at 4)
    assert [p.choose_victim(demand=True) for _ in range(6)] == ["a", "b", "e", "d", "c", None]


def test_a_bucket_passed_by_the_cursor_moves_to_its_next_steps_time():
    p = policy()
    p.begin_step()
    p.offer("c", dirty=False, last_use=0)
    p.offer("e", dirty=False, last_use=0)
    p.note_use("a")
    p.note_use("d")                              # the cursor skips b and c
    assert p.choose_victim(demand=True) == "c"   # next used at BWD position 3 of step 1
    p.begin_step()                               # step 1 (BWD): e at 0 is used first now
    p.offer("a", dirty=False, last_use=0)
    assert p.choose_victim(demand=True) == "a"


def test_tie_break_is_clean_before_dirty_then_least_recently_used():
    """Only buckets never used again can tie (INF): a clean one goes first (no write, its
    buffer frees at once), then the one idle longest."""
    p = ResidencyPolicy(2, alternate=True)       # no schedule: every next use is INF
    p.offer("dirty-old", dirty=True, last_use=1)
    p.offer("clean-new", dirty=False, last_use=9)
    p.offer("clean-old", dirty=False, last_use=2)
    p.offer("dirty-new", dirty=True, last_use=8)
    assert [p.choose_victim(demand=True) for _ in range(4)] == [
        "clean-old", "clean-new", "dirty-old", "dirty-new"]


def test_withdrawn_and_updated_candidates():
    p = policy()
    p.begin_step()
    for k in "cde":
        p.offer(k, dirty=False, last_use=0)
    p.withdraw("e")                              # acquired: held buckets never go
    assert not p.is_candidate("e") and p.is_candidate("d")
    p.offer("d", dirty=True, last_use=5)         # released dirty: still the furthest
    assert p.choose_victim(demand=True) == "d"
    assert p.choose_victim(demand=True) == "c"
    assert p.choose_victim(demand=True) is None


def test_a_prefetch_never_evicts_a_bucket_needed_sooner():
    p = policy(depth=2)
    p.begin_step()
    p.offer("b", dirty=False, last_use=0)        # needed at distance 2
    # fetching d (distance 4) may not evict b, needed sooner
    assert p.choose_victim(demand=False, fetch="d") is None
    assert p.is_candidate("b")
    # fetching a (distance 1) may: b is needed after it
    assert p.choose_victim(demand=False, fetch="a") == "b"
    # and nothing is ever evicted for a bucket needed at the same time (itself)
    p.offer("c", dirty=False, last_use=0)
    assert p.choose_victim(demand=False, fetch="c") is None


def test_a_prefetch_outside_the_schedule_only_evicts_clean_buckets_never_used_again():
    p = policy()
    p.begin_step()
    p.offer("e", dirty=False, last_use=0)        # scheduled: needed again
    p.offer("x", dirty=True, last_use=0)         # unscheduled, but dirty
    assert p.choose_victim(demand=False, fetch="other") is None
    p.offer("y", dirty=False, last_use=0)
    assert p.choose_victim(demand=False, fetch="other") == "y"
    assert p.choose_victim(demand=True) == "x"   # a demand fill may take anything


def test_demand_fills_wait_for_write_backs_rather_than_evict_what_is_about_to_be_used():
    p = policy(depth=2)
    p.begin_step()
    p.offer("a", dirty=False, last_use=0)        # distance 1: inside the prefetch window
    p.writebacks.start("q", 4096, evict_after=True)
    assert p.choose_victim(demand=True) is None  # the write-back will make room
    p.writebacks.finish("q")
    assert p.choose_victim(demand=True) == "a"   # nothing in flight: take it


# -- write-backs and credit ------------------------------------------------------------------------
def test_write_backs_in_flight_and_the_bytes_they_will_free():
    w = WriteBacks()
    w.start("a", 8192, evict_after=True)
    w.start("b", 4096, evict_after=False)        # a flush: the bucket stays
    w.start("c", 4096, evict_after=True)
    assert (w.in_flight, w.freeing) == (3, 12288) and w.evicting("a") and not w.evicting("b")
    w.keep("c")                                  # wanted again before its write landed
    assert w.freeing == 8192 and not w.evicting("c")
    assert w.finish("a") is True and w.finish("b") is False and w.finish("c") is False
    assert (w.in_flight, w.freeing) == (0, 0)


def test_credit_is_handed_out_once_per_pass():
    w = WriteBacks()
    w.start("a", 8192, evict_after=True)
    credit = w.credit()
    assert credit.claim(4096) and credit.claim(4096)
    assert not credit.claim(1)                   # spent: the next fill must evict
    assert w.credit().left == 8192               # a new pass starts from what is in flight
    assert not Credit(0).claim(1)


# -- cost ----------------------------------------------------------------------------------------------
def test_the_candidate_heap_stays_small_while_buckets_are_re_offered():
    """A step re-offers every bucket (release) without any eviction when all fit: stale
    heap entries must not pile up over a long run."""
    keys = list(range(1000))
    p = policy(forward=keys, backward=keys[::-1])
    for _ in range(20):
        p.begin_step()
        for k in p.schedule.order_for(p.schedule.step):
            p.note_use(k)
            p.withdraw(k)
            p.offer(k, dirty=True, last_use=k)
    assert len(p._candidates._heap) <= 2 * len(keys) + 64


@pytest.mark.multiprocess
def test_the_policy_and_the_store_config_import_nothing_heavy():
    """The planner imports both; torch alone takes seconds to import."""
    code = ("import sys; import offload_engine.store.policy, offload_engine.store.geometry; "
            "from offload_engine.store import StoreConfig; "
            "print([m for m in ('torch', 'numpy', 'zarr') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
