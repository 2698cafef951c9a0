"""``batch_sizes="auto"`` on one GPU, a check of ``benchmarks/gpu_check.py``: the probe's answer for a ResNet-18 on
64x64 images (bf16 autocast, Adam), then one real step at that batch (forward, backward, Adam's first step, whose
state the probe reserved): it must fit, its peak within the device's memory. The figures: the batch found, the peak
against the capacity, and the probe's time."""

from __future__ import annotations

import time


def check_auto_batch(device: str, cuda: bool) -> dict:
    if not cuda:
        return {"verdict": "SKIP", "why": "the probe reads the CUDA allocator"}
    import lightning as L
    import torch
    import torchvision
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_oscars.lightning.batch_probe import CudaMemoryGauge, probe_largest_batch

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torchvision.models.resnet18(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

    target = torch.device(device)
    module = Classifier().to(target)
    data = TensorDataset(torch.randn(2048, 3, 64, 64), torch.randint(0, 10, (2048,)))
    loader = DataLoader(data, batch_size=128)
    optimizer = torch.optim.Adam(module.parameters())
    gauge = CudaMemoryGauge(target)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    start = time.perf_counter()
    found = probe_largest_batch(
        module, loader, gauge, to_device=lambda b: [t.to(target) for t in b], context=autocast, optimizers=[optimizer]
    )
    probe_s = time.perf_counter() - start
    x, y = loader.collate_fn([data[i % len(data)] for i in range(found)])
    x, y = x.to(target), y.to(target)
    try:
        with gauge.measure():
            with autocast():
                loss = module.training_step((x, y), 0)
            loss.backward()
            optimizer.step()
    except torch.cuda.OutOfMemoryError as error:
        return {"verdict": "FAIL", "why": f"the probed batch of {found} ran out of memory: {error}"}
    peak, capacity = gauge.peak(), gauge.capacity()
    return {
        "verdict": "PASS" if peak <= capacity else "FAIL",
        "batch_found": found,
        "peak_gib": round(peak / 2**30, 2),
        "capacity_gib": round(capacity / 2**30, 2),
        "peak_fraction_of_capacity": round(peak / capacity, 3),
        "probe_s": round(probe_s, 2),
    }
