"""Lightning: `self.log(..., sync_dist=True)` under `if self.trainer.is_global_zero:` in
on_validation_epoch_end. Only rank 0 all-reduces the metric; rank 1 goes on to Lightning's next
collective. The place is the user's hook line, the fix Lightning's (log on every rank, or
rank_zero_only=True)."""

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "rank_only_collective", "rank": 0, "fix": "rank_zero_only", "options": ["--hang-timeout", "8", "--on-hang", "kill"]}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.val_losses: list[torch.Tensor] = []

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _idx):
        x, y = batch
        self.val_losses.append(nn.functional.cross_entropy(self.net(x), y))

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero:
            self.log("val_loss", torch.stack(self.val_losses).mean(), sync_dist=True)  # zoo: place
        self.val_losses.clear()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
