"""Every function a lesson or a lab check launches (with minizero.launch.run) to measure
something. They sit above the mechanisms and may use anything: models, data, references.

    references.py       the ground truth: one process on the full batch; torch's DDP
    collectives.py      lesson 01: collective timings, the alpha-beta fit
    dp_ddp.py           lesson 02: DataParallel vs DDP modes, overlap, torch DDP
    mixed_precision.py  lesson 03: fp32 / fp16 / bf16 training, underflow, lost updates
    zero12.py           lessons 04-05: DDP and ZeRO-1/2 side by side, buckets, accumulation
    zero3.py            lesson 06: ZeRO-3 memory, bytes and prefetch
"""
