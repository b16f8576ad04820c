"""Test helper: scse_dist.train.parity with DeepSpeed's Muon running Newton–Schulz in fp32.

DeepSpeed runs it in bf16 wherever the device has bf16 (CPU included), and bf16 turns the last-bit
differences of a 2-rank gradient sum into differences of up to a few percent of a Muon update
(measured over 12 steps: 2.1e-5 on a loss, 2.5e-3 on a weight); in fp32 the ranks agree to
float rounding, so a test can hold ZeRO-0/1/2 on 2 ranks to 1 rank tightly.

    python tests/muon_fp32_parity.py --config tiny.yaml --out DIR --stages 0,1,2 [key=value ...]
"""

import sys

import torch
from deepspeed.runtime.zero.muon import original_muon

from scse_dist.train.parity import main

original_muon.ns_compute_dtype = lambda method="gram": torch.float32

if __name__ == "__main__":
    sys.exit(main())
