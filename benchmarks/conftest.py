"""Benchmark setup: one torch thread, as in the tests."""

import torch

torch.set_num_threads(1)
