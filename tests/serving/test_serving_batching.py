"""The search batcher without Ray: calls that queue while a batch runs form the next batch (at
most max_size), a wait gathers more, an exception reaches exactly its batch, and stacked
requests get back exactly their own rows."""

import asyncio

import numpy as np
import pytest

from raycompat.serving.batching import Batcher, split_rows, stacked_groups


def _run(coro):
    return asyncio.run(coro)


def test_calls_that_queue_during_a_batch_form_the_next_one():
    sizes = []

    async def handler(args):
        sizes.append(len(args))
        await asyncio.sleep(0.02)
        return [a * 10 for a in args]

    async def main():
        b = Batcher(handler, max_size=5)
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.005)  # the first batch runs alone; 12 calls queue meanwhile
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 13)]
        return await asyncio.gather(first, *rest)

    assert _run(main()) == [10 * i for i in range(13)]
    assert sizes == [1, 5, 5, 2]


def test_a_wait_gathers_calls_that_arrive_soon_after_the_first():
    sizes = []

    async def handler(args):
        sizes.append(len(args))
        return args

    async def main():
        b = Batcher(handler, max_size=8, max_wait_s=0.2)
        calls = []
        for i in range(4):
            calls.append(asyncio.ensure_future(b.submit(i)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*calls)

    assert _run(main()) == [0, 1, 2, 3] and sizes == [4]


def test_an_exception_reaches_every_call_of_its_batch_and_no_other():
    async def handler(args):
        await asyncio.sleep(0.01)
        if -1 in args:
            raise ValueError("bad batch")
        return args

    async def main():
        b = Batcher(handler, max_size=3)
        first = asyncio.ensure_future(b.submit(7))
        await asyncio.sleep(0.001)
        bad = [asyncio.ensure_future(b.submit(x)) for x in (-1, 2, 3)]
        await asyncio.sleep(0.05)
        later = await b.submit(4)
        return await first, await asyncio.gather(*bad, return_exceptions=True), later

    first, bad, later = _run(main())
    assert first == 7 and later == 4
    assert all(isinstance(e, ValueError) and str(e) == "bad batch" for e in bad)


def test_stacked_groups_give_each_request_its_own_rows():
    rng = np.random.default_rng(0)
    sides = [
        {"old": rng.random((2, 3)), "new": rng.random((2, 4))},
        {"old": rng.random((1, 3))},  # an old-model request: another group
        {"new": rng.random((3, 4)), "old": rng.random((3, 3))},
    ]
    groups = list(stacked_groups(sides, [5, 5, 5], [False, False, False]))
    assert [g[0] for g in groups] == [[0, 2], [1]]
    members, stacked, k, exact = groups[0]
    assert stacked["old"].shape == (5, 3) and (k, exact) == (5, False)
    back = split_rows((stacked["old"], stacked["new"]), [2, 3])
    assert np.array_equal(back[0][0], sides[0]["old"]) and np.array_equal(
        back[1][1], sides[2]["new"]
    )
    assert [g[0] for g in stacked_groups(sides[:1] * 2, [5, 6], [False, False])] == [[0], [1]]
    with pytest.raises(ValueError):
        list(stacked_groups(sides, [5], [False]))
