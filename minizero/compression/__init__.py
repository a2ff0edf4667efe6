"""Compressed communication: fewer bits on the wire, with the error fed back.

    onebit.py       1-bit sign + scale compression with error feedback, and compressed_allreduce
                    (1-bit all-to-all, then 1-bit all-gather, DeepSpeed's compressed_allreduce);
                    byte formulas (lab 13)
    onebit_adam.py  OneBitAdam (Tang et al. 2021): Adam warm-up, then the variance frozen and the
                    momentum all-reduced in 1 bit; bytes per step per phase; end_to_end_reduction
    zero_one_adam.py  ZeroOneAdam (0/1 Adam, Lu et al. 2022): adaptive variance freezing, then local
                    steps synchronised in 1 bit; ZeroOnePolicy (lab 13's stretch), bytes_at
"""
from minizero.compression.onebit import (bytes_allreduce, bytes_compressed, compress,
                                         compressed_allreduce, pack_signs, padded_numel,
                                         unpack_signs)
from minizero.compression.onebit_adam import OneBitAdam, end_to_end_reduction
from minizero.compression.zero_one_adam import ZeroOneAdam, ZeroOnePolicy

__all__ = ["OneBitAdam", "ZeroOneAdam", "ZeroOnePolicy", "bytes_allreduce", "bytes_compressed",
           "compress", "compressed_allreduce", "end_to_end_reduction", "pack_signs", "padded_numel",
           "unpack_signs"]
