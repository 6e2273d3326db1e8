"""End-to-end serving benchmarks (issue 7): loraplex against transformers(+PEFT) peers and the floor.

Entry point: `python benchmarks/e2e/run.py --quick|--full|--tiny [--gpu]` (see benchmarks/README.md).
Modules, one job each:
    workload  trace requests -> concrete requests (token-id prompts) and random PEFT adapter folders
    systems   the four systems behind one interface (serve a list of requests, return per-request records)
    metrics   per-run metrics (throughput, TTFT, inter-token latency, SLO attainment) and output matching
    modes     offline (all at once) and online (arrival replay) runs of several systems on the same requests
    ceiling   the roofline in the same run, FLOPs per decode token, decode at batch 64 as a share of it
    scaling   1 / 10 / 100 / 1000 adapters on one trace, host cache and pool counters, floor-predicted loss
    plot      the adapter-scaling PNG
    run       the one entry point (--quick, --full, --tiny, --gpu)
"""
