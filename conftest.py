"""Root conftest: doctests in the package run with one torch thread too."""

import torch

torch.set_num_threads(1)
