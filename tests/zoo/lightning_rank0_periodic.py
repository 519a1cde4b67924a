"""Lightning, rank 0 writes a slow sample dump every 5 batches in on_train_batch_end: every
other rank waits for it at the next gradient sync."""

import time

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 0, "fix": "background", "options": []}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, _out, _batch, idx):
        if self.global_rank == 0 and idx % 5 == 4:
            time.sleep(0.25)

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
