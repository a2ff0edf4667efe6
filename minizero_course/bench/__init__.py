"""`python -m minizero_course bench`: minizero against its peers, in the same job.

    bench.py       the runner: interleaved step times, paired ratios, ledger, RSS, bytes
    common.py      what every bench shares: the sleeping barrier, a timed step, the paired
                   ratio, the report/--json/--plot ending
    candidates.py  how each candidate is built: minizero DDP/ZeRO-1/2/3, torch DDP, FSDP2,
                   DeepSpeed ZeRO-0..3 (when the `peers` extra is installed)
    pipeline.py    `bench pipeline`: minizero's schedules vs torch.distributed.pipelining, and the
                   measured bubble against the formulas
    tensor_parallel.py  `bench --tp`: minizero TP next to torch DTensor TP (parallelize_module) at each t
"""
