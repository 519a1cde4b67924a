"""Lightning with an auxiliary head whose output is never used: DDP (strategy="ddp") fails at the
second step. The fix is in Lightning's terms: strategy="ddp_find_unused_parameters_true"."""

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "unused_parameters", "rank": None, "fix": "ddp_find_unused_parameters_true", "options": ["--hang-timeout", "10", "--on-hang", "kill"]}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 2)

    def training_step(self, batch, _idx):
        x, y = batch
        h = torch.relu(self.body(x))
        _aux = self.aux(h)
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
