"""Leader election over the in-process store on a fake clock: one leader among three,
a takeover when the leader's lease runs out, resigning hands over, never two leaders."""

from __future__ import annotations

import asyncio

from store_kits import MemoryKit

from meshnet_tracker.store import Election

TTL_S = 3.0
STEP_S = 1.0  # each candidate steps once per second: a third of the TTL


def candidates(kit: MemoryKit, store, count: int = 3) -> list[Election]:
    return [Election(store, "swarm", f"tracker-{n}", TTL_S, clock=kit.clock) for n in range(count)]


async def tick(kit: MemoryKit, elections: list[Election]) -> list[str]:
    """One heartbeat: every candidate steps, then a second passes. The leaders, checked
    after each candidate's step (no two at any moment)."""
    for election in elections:
        await election.step()
        leaders = [e.candidate_id for e in elections if e.is_leader]
        assert len(leaders) <= 1, leaders
    await kit.pass_time(STEP_S)
    return [e.candidate_id for e in elections if e.is_leader]


def test_one_leader_among_three_candidates_and_everyone_knows_who():
    async def main():
        kit = MemoryKit()
        store = kit.open()
        elections = candidates(kit, store)
        for _ in range(10):
            await tick(kit, elections)
        leaders = [e for e in elections if e.is_leader]
        assert [e.candidate_id for e in leaders] == ["tracker-0"]  # the first to step
        assert {await e.leader() for e in elections} == {"tracker-0"}

    asyncio.run(main())


def test_another_candidate_takes_over_when_the_leaders_lease_runs_out():
    async def main():
        kit = MemoryKit()
        store = kit.open()
        elections = candidates(kit, store)
        await tick(kit, elections)
        old = next(e for e in elections if e.is_leader)
        others = [e for e in elections if e is not old]  # the leader stops stepping (killed)
        seen = []
        for _ in range(int(TTL_S / STEP_S) + 2):
            for election in others:
                await election.step()
                assert sum(e.is_leader for e in elections) <= 1
            seen.append([e.candidate_id for e in elections if e.is_leader])
            await kit.pass_time(STEP_S)
        assert not old.is_leader  # its own clock stepped it down, before anyone took over
        new = [e for e in others if e.is_leader]
        assert len(new) == 1 and await new[0].leader() == new[0].candidate_id
        assert seen[-1] == [new[0].candidate_id]
        await old.step()  # it comes back: the leader it finds stays
        assert not old.is_leader and new[0].is_leader

    asyncio.run(main())


def test_a_leader_that_misses_a_step_but_not_its_ttl_stays_leader():
    async def main():
        kit = MemoryKit()
        store = kit.open()
        elections = candidates(kit, store)
        await tick(kit, elections)
        await kit.pass_time(TTL_S - STEP_S - 0.5)  # late, within the TTL
        for _ in range(5):
            assert await tick(kit, elections) == ["tracker-0"]

    asyncio.run(main())


def test_resigning_hands_over_to_the_next_candidate():
    async def main():
        kit = MemoryKit()
        store = kit.open()
        elections = candidates(kit, store)
        await tick(kit, elections)
        assert elections[0].is_leader
        await elections[0].resign()
        assert not elections[0].is_leader
        assert await elections[0].leader() is None  # the key went with the lease
        assert await tick(kit, elections) == ["tracker-1"]  # tracker-0 stepped first, stood aside
        for _ in range(5):
            assert await tick(kit, elections) == ["tracker-1"]

    asyncio.run(main())


def test_a_deleted_leader_key_is_noticed_and_campaigned_for_again():
    async def main():
        kit = MemoryKit()
        store = kit.open()
        elections = candidates(kit, store, 2)
        await tick(kit, elections)
        await store.delete("swarm/leader")  # an operator clears it by hand
        leaders = await tick(kit, elections)
        assert len(leaders) == 1
        assert await elections[0].leader() == leaders[0]

    asyncio.run(main())
