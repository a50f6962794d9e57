import numpy as np
import pytest

from lucekv.spark.cache import COLD, DECAY_STEPS, ExpertSlots, Fill
from lucekv.spark.placement import Placement, Swap


def test_the_placement_is_pinned_and_cold_experts_fill_spare_slots_least_recent_out_first():
    slots = ExpertSlots(Placement("fp", 8, ((5, 2),)), spare=2)
    assert slots.remap[0].tolist() == [COLD, COLD, 1, COLD, COLD, 0, COLD, COLD] and slots.slots(0) == 4
    assert slots.admit(0, [5, 3]) == [Fill(0, 3, 2, COLD)]
    assert slots.admit(0, [0]) == [Fill(0, 0, 3, COLD)]
    assert slots.admit(0, [3]) == []  # cached: now the most recent
    assert slots.admit(0, [7, 2]) == []  # the gate: 7 (once) is not busier than the least recent spare's 0 (once)
    assert slots.admit(0, [7, 2]) == [Fill(0, 7, 3, 0)]  # now it is: expert 0, the least recent spare, goes
    assert slots.remap[0, 0] == COLD and slots.remap[0, 7] == 3 and slots.remap[0, 3] == 2
    assert slots.cold(0, [0, 3, 5, 6]) == [0, 6]


def test_experts_selected_together_never_evict_each_other():
    slots = ExpertSlots(Placement("fp", 8, ((0,),)), spare=2)
    fills = slots.admit(0, [1, 2, 3, 4])
    assert [f.expert for f in fills] == [1, 2]  # two spares: 3 and 4 stay cold this step
    assert slots.cold(0, [1, 2, 3, 4]) == [3, 4]
    assert slots.admit(0, [1, 2, 3]) == []  # 1 and 2 are needed now: nothing to evict


def test_epoch_changes_exactly_when_the_remap_does():
    slots = ExpertSlots(Placement("fp", 4, ((0,), (1,))), spare=1)
    assert slots.epoch == 0
    slots.admit(0, [0])
    assert slots.epoch == 0
    slots.admit(1, [2])
    assert slots.epoch == 1
    slots.admit(1, [2])
    assert slots.epoch == 1


def test_random_traffic_keeps_the_slots_consistent_and_matches_a_plain_gated_lru():
    rng = np.random.default_rng(3)
    n_expert, spare = 16, 3
    hot = (0, 1, 2, 3)
    slots = ExpertSlots(Placement("fp", n_expert, (hot,)), spare=spare)
    lru: list[int] = []  # reference: cached experts, least recent first
    counts = np.zeros(n_expert)  # the gate's, decayed
    for step in range(1, 501):
        chosen = list(rng.choice(n_expert, 4, replace=False, p=np.linspace(2, 1, n_expert) / 24))
        slots.admit(0, chosen)
        counts[chosen] += 1  # the same rule, written plainly
        if step % DECAY_STEPS == 0:
            counts /= 2
        for e in chosen:
            if e in lru:
                lru.remove(e)
                lru.append(e)
        for e in chosen:
            if e in hot or e in lru:
                continue
            if len(lru) == spare:
                victims = [old for old in lru if old not in chosen]
                if not victims:
                    break
                if counts[e] <= counts[victims[0]]:
                    continue
                lru.remove(victims[0])
            lru.append(e)
        remap = slots.remap[0]
        resident = np.flatnonzero(remap != COLD)
        assert sorted(resident.tolist()) == sorted([*hot, *lru])
        assert len(set(remap[resident].tolist())) == len(resident) < slots.slots(0) + 1  # one expert per slot
        assert all(remap[e] == i for i, e in enumerate(hot))  # the placement never moves


def test_a_filled_expert_shows_only_at_the_next_boundary_and_an_evicted_one_at_once():
    slots = ExpertSlots(Placement("fp", 8, ((0,),)), spare=1)
    first = slots.admit(0, [3])
    assert slots.visible(first)[0].tolist() == [0] + [COLD] * 7  # 3's copy is on its way
    assert slots.visible([])[0, 3] == 1  # the next boundary: shown
    assert slots.admit(0, [4]) == []  # the gate: 4 is not busier than 3 yet
    second = slots.admit(0, [4])  # now it is: evicts 3 from slot 1
    visible = slots.visible(second)
    assert visible[0, 3] == COLD and visible[0, 4] == COLD


def test_the_device_remap_never_shows_a_slot_whose_copy_may_be_unfinished_or_being_overwritten():
    """The step-boundary protocol of backends/cuda_spark, replayed on random traffic: at boundary b the device remap
    is visible(fills of b); the copies of b start after every step that read an earlier remap and have finished
    before boundary b + 1's remap is uploaded. So a slot the remap shows must hold, by then, the expert it names
    (its copy issued at an earlier boundary), and no copy of boundary b may write a slot that remap b shows."""
    rng = np.random.default_rng(11)
    n_expert, spare, hot = 12, 3, (0, 1)
    slots = ExpertSlots(Placement("fp", n_expert, (hot,)), spare=spare)
    landed = dict(enumerate(hot))  # slot -> the expert whose bytes it holds once the copies issued so far are done
    for step in range(400):
        if step % 40 == 39:  # a request's end: a promotion (of a cached expert or a cold one)
            placed = slots.placement.hot[0]
            fills = slots.promote([Swap(0, placed[step % 2], int(rng.choice(
                [e for e in range(n_expert) if e not in placed])), 1)])
        else:
            fills = slots.admit(0, rng.choice(n_expert, 3, replace=False, p=np.geomspace(4, 1, n_expert)
                                              / np.geomspace(4, 1, n_expert).sum()))
        remap = slots.visible(fills)[0]
        shown = {int(remap[e]): e for e in range(n_expert) if remap[e] != COLD}
        assert all(landed.get(slot) == e for slot, e in shown.items())  # copies of earlier boundaries: done
        assert not {f.slot for f in fills} & set(shown)  # this boundary's copies write slots no step reads
        for f in fills:
            landed[f.slot] = f.expert


def test_a_promotion_takes_the_demoted_experts_slot_and_frees_the_spare_that_cached_it():
    slots = ExpertSlots(Placement("fp", 8, ((0, 1),)), spare=1)
    slots.admit(0, [5])  # cached in spare slot 2
    assert slots.promote([Swap(0, 1, 5, 3)]) == [Fill(0, 5, 1, 1)]
    assert slots.placement.hot == ((0, 5),) and slots.remap[0].tolist() == [0, COLD, COLD, COLD, COLD, 1, COLD, COLD]
    assert slots.admit(0, [6]) == [Fill(0, 6, 2, COLD)]  # the freed spare
    with pytest.raises(ValueError, match="not placed"):
        slots.promote([Swap(0, 1, 7, 1)])
