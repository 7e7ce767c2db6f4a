"""`specdec bench-device`: the decoder checked and priced on an accelerator (CUDA), in one run.

    exactness.py  the tiny-model exactness suite, on any device (also run by tests/test_device.py)
    costs.py      verify-cost curves and BMC vs DynamicCache step times on random-weight Llama shapes
    pricing.py    CPU-recorded acceptance traces priced by those curves (MagicDec's and BASS's regimes)
    traces.py     records those traces on the CPU with the real model (`python -m specdec.bench.device.traces`)
    command.py    the command: a plan under a time budget, JSON written as each part finishes, --dry-run
"""
