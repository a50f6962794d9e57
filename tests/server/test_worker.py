"""The worker's channel to a Generate call: deltas that arrive while the call is busy come as one, in order, and
whatever ends the generation (its last item, an error) ends the stream after the deltas before it."""

from __future__ import annotations

import asyncio

import pytest

from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta, TokenLogprob, Usage
from lucekv.server.worker import _END, GenerationJob, deliver_all, joined


def test_joined_deltas_keep_every_token_text_and_logprob_in_order_and_the_last_ones_end():
    usage = Usage(5, 0, 3, 0.1, 20.0)
    deltas = [GenerationDelta([1], "a", [TokenLogprob(1, -0.5, [])]),
              GenerationDelta([2, 3], "", [TokenLogprob(2, -1.0, [(2, -1.0)]), TokenLogprob(3, -0.1, [])]),
              GenerationDelta([4], "bc", [TokenLogprob(4, -2.0, [])], "length", usage)]
    one = joined(deltas)
    assert one.token_ids == [1, 2, 3, 4] and one.text == "abc"
    assert [lp.token_id for lp in one.logprobs] == [1, 2, 3, 4] and one.logprobs[1].top == [(2, -1.0)]
    assert one.finish_reason == "length" and one.usage is usage
    assert joined([GenerationDelta([7], "x"), GenerationDelta([8], "y")]).logprobs is None
    assert joined(deltas[:1]) is deltas[0]


async def _stream(items: list[list[object]]) -> list[GenerationDelta]:
    """The deltas a call reads when the engine thread delivers `items`, one batch per step, each batch before the
    call reads again (the call is behind)."""
    job = GenerationJob([1], SamplingParams(), "r")
    for batch in items:
        deliver_all([(job, item) for item in batch])
    await asyncio.sleep(0)  # the deliveries run on the loop
    return [d async for d in job.deltas()]


def test_a_call_behind_the_engine_reads_what_arrived_as_one_delta_then_the_end():
    steps = [[GenerationDelta([1], "a")], [GenerationDelta([2], "b")], [GenerationDelta([3], "c", None, "length")],
             [_END]]
    out = asyncio.run(_stream(steps))
    assert [(d.token_ids, d.text, d.finish_reason) for d in out] == [([1, 2, 3], "abc", "length")]


def test_an_error_ends_the_stream_after_the_deltas_before_it():
    read: list[GenerationDelta] = []

    async def run():
        job = GenerationJob([1], SamplingParams(), "r")
        deliver_all([(job, GenerationDelta([1], "a")), (job, RuntimeError("engine failed")),
                     (job, GenerationDelta([2], "b"))])
        async for d in job.deltas():
            read.append(d)

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(run())
    assert [d.token_ids for d in read] == [[1]]


def test_a_waiting_call_wakes_for_each_delivery():
    async def run():
        job = GenerationJob([1], SamplingParams(), "r")
        got = []

        async def read():
            async for d in job.deltas():
                got.append(d.token_ids)

        reader = asyncio.ensure_future(read())
        for i in range(3):
            await asyncio.sleep(0.01)  # the reader waits
            deliver_all([(job, GenerationDelta([i], str(i)))])
        await asyncio.sleep(0.01)
        deliver_all([(job, _END)])
        await asyncio.wait_for(reader, 5)
        return got

    assert asyncio.run(run()) == [[0], [1], [2]]
