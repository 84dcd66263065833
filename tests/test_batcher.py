"""The prefill batcher: arrival order, a token budget that bounds a batch, carried jobs first."""

from __future__ import annotations

from types import SimpleNamespace

from prefill.batcher import Batcher, PrefillJob


def job(tokens: int, at: float) -> PrefillJob:
    return PrefillJob(SimpleNamespace(num_tokens=tokens), None, enqueued=at)


def sizes(batch: list[PrefillJob]) -> list[int]:
    return [j.tokens for j in batch]


def test_a_batch_holds_at_most_the_budget_or_one_prompt_alone():
    b = Batcher(100)
    for i, n in enumerate((40, 50, 30, 150, 20, 100)):
        b.put(job(n, i))
    b.close()
    batches = []
    while (batch := b.next_batch()) is not None:
        batches.append(sizes(batch))
    # 40+50 = 90; 30 would cross 100: it opens the next; 150 alone; 20 then 100 crosses
    assert batches == [[40, 50], [30], [150], [20], [100]]


def test_carried_jobs_go_first_in_arrival_order():
    b = Batcher(100)
    late, early = job(30, 2.0), job(30, 1.0)
    b.carry(late)
    b.carry(early)  # carried after, arrived before: goes first
    b.put(job(30, 3.0))
    b.put(job(30, 4.0))
    assert [j.enqueued for j in b.next_batch()] == [1.0, 2.0, 3.0]
    assert [j.enqueued for j in b.next_batch()] == [4.0]


def test_a_carried_job_that_does_not_fit_keeps_the_queue_behind_it():
    b = Batcher(100)
    b.carry(job(60, 1.0))
    b.carry(job(60, 2.0))
    b.put(job(10, 3.0))
    assert sizes(b.next_batch()) == [60]  # the 10 would fit, but it came later
    assert sizes(b.next_batch()) == [60, 10]
