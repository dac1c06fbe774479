"""Toy model, loss, harvested data and an open training window shared by the spot trainer tests."""
from __future__ import annotations

import torch
from torch import nn

import torch.distributed as dist

from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig, HarvestSample

H = 6


def regression_loss(model: nn.Module, samples: list[HarvestSample]) -> torch.Tensor:
    """Predict the next feature from the current one (an EAGLE-like toy objective)."""
    x = torch.cat([s.hidden[:-1] for s in samples]).float()
    y = torch.cat([s.hidden[1:] for s in samples]).float()
    return (model(x) - y).pow(2).mean()


def toy_model(seed: int = 0) -> nn.Module:
    model = nn.Linear(H, H)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def toy_buffer(seed: int = 0, n: int = 16, step: int = 0) -> HarvestBuffer:
    """Sequences following a fixed linear map f_{t+1} = A f_t, so the loss can go to ~0."""
    g = torch.Generator().manual_seed(seed)
    A = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(123)))[0]
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, hidden_dtype="float32"), start_step=step)
    for _ in range(n):
        f = [torch.randn(H, generator=g)]
        for _ in range(7):
            f.append(A @ f[-1])
        buf.add(torch.randint(0, 50, (9,), generator=g), torch.stack(f), step=step)
    return buf


def open_coordinator() -> WorkerCoordinator:
    """Rank 0 idle, rank 1 still busy: training may go on until someone preempts."""
    store = dist.HashStore()
    coord = WorkerCoordinator(store, 0, 2, min_idle_workers=1)
    WorkerCoordinator(store, 1, 2, min_idle_workers=1)
    coord.mark_idle()
    coord.start_training()
    return coord
