"""Lightning, rank 1 slow in every training_step (Python-side feature work): it arrives last at
every gradient sync, and the lost time is in forward (training_step), not in the optimizer
step that Lightning wraps around forward and backward."""

import time

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "straggler", "rank": 1, "fix": "forward", "options": []}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, _idx):
        x, y = batch
        if self.global_rank == 1:
            time.sleep(0.03)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 16), torch.randint(0, 4, (640,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
