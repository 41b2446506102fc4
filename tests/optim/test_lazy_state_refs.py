"""optim/lazy_state.WeakLists: the StoreTensors an optimizer handed out, held weakly with no
callback (a WeakSet's callback is where a Ctrl-C was lost: its KeyboardInterrupt, raised in
Python code run as an object died, is printed as "ignored")."""

import gc
import weakref

from offload_engine.optim.lazy_state import WeakLists


class Thing:
    pass


def test_live_lists_only_live_objects_by_key_and_across_keys():
    lists = WeakLists()
    kept = [Thing() for _ in range(3)]
    lists.add("a", kept[0])
    lists.add("b", kept[1])
    lists.add("b", kept[2])
    lists.add("b", Thing())  # dies at once
    gc.collect()
    assert lists.live("a") == [kept[0]]
    assert lists.live("b") == kept[1:]
    assert lists.live("nothing") == []
    assert sorted(map(id, lists.live())) == sorted(map(id, kept))


def test_dead_objects_are_swept_so_the_lists_stay_bounded():
    lists = WeakLists()
    kept = Thing()
    lists.add(0, kept)
    for i in range(10_000):  # state dicts made and dropped step after step
        lists.add(i % 7, Thing())
    held = sum(len(refs) for refs in lists._refs.values())
    assert held <= 200, held
    assert lists.live(0) == [kept]


def test_no_callback_runs_when_an_object_dies():
    lists = WeakLists()
    obj = Thing()
    lists.add("k", obj)
    assert weakref.getweakrefcount(obj) == 1
    assert weakref.getweakrefs(obj)[0].__callback__ is None
