"""One rank of the GPU report's part 4, started by torchrun: ``tests/distributed_worker.py`` on CUDA.

The worker's loss cases are what ``tests/test_distributed.py`` checks on two CPU ranks; here the same
functions run with the models and batches on this rank's GPU and the process group on the backend
the report chose (NCCL, or gloo carrying CUDA tensors where NCCL refuses two ranks on one GPU), so
the comparison with one process is the tests' own, on the accelerator. Without CUDA (the report's dry
run) nothing is moved and the worker runs as the tests run it.

    torchrun --nproc_per_node 2 tools/gpu_report_ranks.py --backend nccl losses --model M --guide G --out O CASE...
    torchrun --nproc_per_node 2 tools/gpu_report_ranks.py --backend nccl --stages 2,3 deepspeed --model M ...
    torchrun --nproc_per_node 2 tools/gpu_report_ranks.py --backend nccl probe --out O
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def local_device():
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def on_device(worker, device, backend: str) -> None:
    """Point the worker's model loading, featurising and process-group set-up at ``device`` and ``backend``."""
    import torch.distributed as dist

    from st_ext._compat import preprocess

    load_model, load_guide, init_process_group = worker.load_model, worker.load_guide, dist.init_process_group
    worker.load_model = lambda *args, **kwargs: load_model(*args, **kwargs).to(device)
    worker.load_guide = lambda *args, **kwargs: load_guide(*args, **kwargs).to(device)
    worker.features_of = lambda model, columns: [preprocess(model, column, device) for column in columns]
    dist.init_process_group = lambda *args, **kwargs: init_process_group(backend)
    try:
        import deepspeed
    except ImportError:
        return
    init_distributed = deepspeed.init_distributed
    deepspeed.init_distributed = lambda *args, **kwargs: init_distributed(dist_backend=backend)


def probe(backend: str, out: Path) -> None:
    """An all-reduce and a reduce-scatter between the two ranks: whether ``backend`` works here at all."""
    import torch
    import torch.distributed as dist

    device = local_device()
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(total)
    shard = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * world, device=device))
    result = {"rank": rank, "all_reduce": total.tolist(), "reduce_scatter": shard.tolist(), "device": str(device)}
    (out / f"probe-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    argv, options = sys.argv[1:], {"--backend": "gloo", "--stages": None}
    while argv[0] in options:
        options[argv[0]], argv = argv[1], argv[2:]
    backend = options["--backend"]
    if argv[0] == "probe":
        probe(backend, Path(argv[argv.index("--out") + 1]))
        return
    import distributed_worker as worker

    on_device(worker, local_device(), backend)
    if options["--stages"]:  # the ZeRO stages the deepspeed mode runs (the worker's default: all three)
        worker.ZERO_STAGES = tuple(int(stage) for stage in options["--stages"].split(","))
    sys.argv = [worker.__file__, *argv]
    worker.main()


if __name__ == "__main__":
    main()
