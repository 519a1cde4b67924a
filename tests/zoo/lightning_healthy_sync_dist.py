"""Healthy Lightning twin: strategy="ddp" and `self.log(..., sync_dist=True)` each step. The
logging all_reduce runs inside the wrapped forward; it is not SyncBatchNorm, and nothing here
is wrong."""

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, _idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8, shuffle=True))


if __name__ == "__main__":
    main()
