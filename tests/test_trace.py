"""Trace arithmetic: coverage counts each instant once, hops fill the router's gaps."""

from __future__ import annotations

from pdserve.trace import Span, coverage, hops, read_jsonl, stages, write_jsonl


def test_coverage_counts_overlaps_once_and_ignores_details():
    spans = [
        Span("router.queue", 0.0, 1.0),
        Span("decode.reserve", 0.5, 2.0),  # overlaps the queue by 0.5
        Span("decode.step", 2.0, 9.0),  # a detail: not counted
        Span("decode.run", 3.0, 4.0),  # a gap of 1.0 before it
    ]
    assert coverage(spans, 0.0, 5.0) == (2.0 + 1.0) / 5.0
    assert coverage(spans, 0.0, 0.0) == 0.0
    assert [s.name for s in stages(spans)] == ["router.queue", "decode.reserve", "decode.run"]


def test_hops_span_the_rpc_gaps_between_worker_spans():
    prefill = [Span("prefill.queue", 2.0, 3.0, "p"), Span("transfer.tail", 4.0, 5.0, "p")]
    decode = [Span("decode.admission", 7.0, 8.0, "d"), Span("decode.run", 8.0, 9.0, "d")]
    got = hops((1.5, 5.5, 6.0, 9.5), prefill, decode)
    assert [(s.name, s.start, s.end) for s in got] == [
        ("rpc.prefill", 1.5, 2.0),
        ("rpc.prefill_reply", 5.0, 5.5),
        ("rpc.start", 6.0, 7.0),
        ("router.stream", 9.0, 9.5),
    ]


def test_jsonl_round_trip(tmp_path):
    rec = {"request_id": "r", "arrival": 1.0, "end": 2.0, "spans": [Span("x", 1.0, 2.0).to_dict()]}
    write_jsonl(tmp_path / "t.jsonl", [rec, rec])
    back = read_jsonl(tmp_path / "t.jsonl")
    assert len(back) == 2 and back[0]["spans"] == [Span("x", 1.0, 2.0)]


def test_a_long_requests_steps_fold_into_one_span_per_run_past_the_first_256():
    """A decode stream's first STEP_SPANS steps are a span each; later steps extend one
    decode.steps span per run (a preemption starts a new one): the trace stays bounded."""
    from decode.streams import STEP_SPANS, Stream

    stream = Stream("d")
    for i in range(STEP_SPANS + 40):
        stream.stepped(100.0 + i, 100.5 + i)
    stream.preempted_at = 500.0
    for i in range(5):
        stream.stepped(600.0 + i, 600.5 + i)
    names = [s.name for s in stream.spans]
    assert names == (
        ["decode.admission"]
        + ["decode.step"] * STEP_SPANS
        + ["decode.steps", "decode.preempted", "decode.steps"]
    )
    first, preempted, second = stream.spans[-3:]
    assert (first.start, first.end) == (100.0 + STEP_SPANS, 100.5 + STEP_SPANS + 39)
    assert (preempted.start, preempted.end) == (500.0, 600.0)
    assert (second.start, second.end) == (600.0, 604.5)
    assert stream.spans[STEP_SPANS].end == 100.5 + STEP_SPANS - 1  # the last one listed
