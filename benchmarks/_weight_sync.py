"""Weight-sync latency probe: ``ray.put`` once, two actors load the weights (a copy into their own tensors).

Run as a script by ``benchmarks/test_scaling.py`` in a fresh process, because Ray reads
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` when it is imported. Prints one JSON object:
``{payload: {"mb": size, method: median seconds}}``.

Methods: ``torch`` puts the state_dict as it is (Ray pickles each tensor, or with the environment
variable set sends it zero-copy); ``packed`` is what ``RayTokenCollector.update_policy_weights_``
does (``pack_weights``: uint8 NumPy views, zero-copy without the variable).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

torch.set_num_threads(1)


class Loader:
    """A stand-in for a worker's ``model.load_state_dict``: copies every received tensor once."""

    def load(self, weights, is_packed: bool) -> int:
        from tokengym.collectors._ray_worker import unpack_weights

        tensors = unpack_weights(weights) if is_packed else weights
        self.params = {name: t.clone() for name, t in tensors.items()}
        return len(self.params)


def payloads(synthetic_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    from tokengym.testing import tiny_model, tiny_tokenizer

    tiny = tiny_model(tiny_tokenizer()).state_dict()
    small = tiny_model(tiny_tokenizer(2048), size="small").state_dict()
    n = synthetic_mb // 4  # 4 MiB float32 tensors
    synthetic = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)}
    return {"tiny": tiny, "small": small, f"synthetic {synthetic_mb} MiB": synthetic}


def main(rounds: int = 3, synthetic_mb: int = 500) -> dict:
    import ray

    from tokengym.collectors._ray_worker import pack_weights

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actors = [ray.remote(num_cpus=1)(Loader).remote() for _ in range(2)]
        ray.get([a.load.remote({"w": torch.zeros(1)}, False) for a in actors])  # processes up
        out = {}
        for name, weights in payloads(synthetic_mb).items():
            mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
            times: dict[str, list[float]] = {"torch": [], "packed": []}
            for _ in range(rounds):
                for method in times:  # interleaved
                    start = time.perf_counter()
                    is_packed = method == "packed"
                    ref = ray.put(pack_weights(weights) if is_packed else weights)
                    ray.get([a.load.remote(ref, is_packed) for a in actors])
                    times[method].append(time.perf_counter() - start)
                    del ref
            out[name] = {"mb": mb, **{m: statistics.median(t) for m, t in times.items()}}
        return out
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
