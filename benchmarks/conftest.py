"""Benchmark setup: one torch thread, as in the tests; same-run ratio tables printed at the end."""

from collections import defaultdict

import pytest
import torch

torch.set_num_threads(1)

_THROUGHPUT: dict = defaultdict(dict)
_BYTES: dict = {}


@pytest.fixture(scope="session")
def throughput_table():
    """(size, B) -> {method: tokens/s}, filled by benchmarks/test_collector_throughput.py."""
    return _THROUGHPUT


@pytest.fixture(scope="session")
def bytes_table():
    """buffer length -> bytes stored per step and slot."""
    return _BYTES


def pytest_terminal_summary(terminalreporter):
    if _THROUGHPUT:
        methods = sorted({m for row in _THROUGHPUT.values() for m in row})
        write = terminalreporter.write_line
        write("")
        write("collector throughput, tokens/s (ratio to raw_generate, same run)")
        write("| model | B | " + " | ".join(methods) + " |")
        write("|---" * (len(methods) + 2) + "|")
        for (size, B), row in sorted(_THROUGHPUT.items()):
            base = row.get("raw_generate")
            cells = []
            for m in methods:
                if m not in row:
                    cells.append("-")
                else:
                    ratio = f" ({row[m] / base:.2f}x)" if base else ""
                    cells.append(f"{row[m]:.0f}{ratio}")
            write(f"| {size} | {B} | " + " | ".join(cells) + " |")
    if _BYTES:
        terminalreporter.write_line("bytes stored per step and slot: " + ", ".join(
            f"max_length {k}: {v:.0f} B" for k, v in sorted(_BYTES.items())))
