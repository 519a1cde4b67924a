"""Lightning: the validation accuracy is logged with sync_dist=True, but only on the global-zero
rank (`if self.trainer.is_global_zero:` in on_validation_epoch_end). sync_dist makes the log an
all_reduce that rank 1 never joins: rank 0 waits in it while rank 1 goes on. The root is rank
0's self.log in on_validation_epoch_end; the fix is Lightning's (log on every rank, or
rank_zero_only=True without sync_dist)."""

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": None, "rank": 0, "fix": ["rank_zero_only", "every rank"], "never": ["skipped the barrier"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class Classifier(L.LightningModule):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))
        self.correct = 0
        self.seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.correct += int((self.model(x).argmax(1) == y).sum())
        self.seen += len(y)

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero:
            acc = torch.tensor(self.correct / max(self.seen, 1))
            self.log("val_acc", acc, sync_dist=True)  # zoo: place
        self.correct = self.seen = 0

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(192, 8), torch.randint(0, 3, (192,)))
    val = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Classifier(), DataLoader(train, batch_size=16), DataLoader(val, batch_size=16))
