"""One step's summary (extproc/tools/calibrate/steps.py), on synthetic records."""

from extproc.tools.calibrate.steps import step_summary
from extproc.tools.loadgen import RequestKind, RequestRecord, Workload


def test_ttft_is_read_from_the_streamed_kinds_only():
    # A half-streamed RAG workload: the non-streamed answers' "first token" is the whole body, and their latencies
    # filled the TTFT column (2.66 s where the streamed first tokens came within 0.5 s).
    workload = Workload([RequestKind(name="rag-stream", stream=True), RequestKind(name="rag-json", stream=False)])
    records = [RequestRecord(start=i * 0.1, kind="rag-stream", url="u", status=200, latency=2.0, ttft=0.2 + i / 100)
               for i in range(10)]
    records += [RequestRecord(start=i * 0.1, kind="rag-json", url="u", status=200, latency=3.0, ttft=3.0)
                for i in range(10)]
    summary = step_summary(records, (0.0, 10.0), workload)
    assert 0.2 <= summary["ttft_p95"] <= 0.3
    assert summary["latency_p95"] == 3.0 and summary["ok"] == 20
