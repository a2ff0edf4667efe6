"""`python -m minizero bench`: minizero against its peers, in the same job.

    bench.py       the runner: interleaved step times, paired ratios, ledger, RSS, bytes
    candidates.py  how each candidate is built: minizero DDP/ZeRO-1/2/3, torch DDP, FSDP2,
                   DeepSpeed ZeRO-0..3 (when the `peers` extra is installed)
"""
