"""Contract clause classification (legal text) with DDP (gloo, CPU).

What the job does
    Synthetic contract clauses (bag of legal tokens, deterministic generator) are
    classified into 6 clause types (indemnification, termination, confidentiality,
    governing law, limitation of liability, assignment).  The model, ClauseModel, is
    an EmbeddingBag encoder with two heads: the clause-type head and a citation head
    (does the clause cite a statute?) that the multi-task paper version of the model
    uses.  This training script only optimises clause type; it is wrapped in plain
    DDP (find_unused_parameters left at its default, False).

Root cause
    ClauseModel.forward always returns (clause_logits, citation_logits), and the
    training step unpacks `clause_logits, _ = model(...)`: the citation head's weight
    and bias never receive a gradient.  DDP's reducer waits for them, the first
    backward never finishes its reduction, and the next forward raises
    "Expected to have finished reduction in the prior iteration before starting a new
    one ..." on every rank (job exits non-zero at step 1).

Fix
    Stop computing / registering the citation head when it is not trained (or add its
    loss), or pass find_unused_parameters=True to DDP (costs a graph traversal per step).

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 1 after ~5 s.  Step 0 trains ("epoch 0 step 0 loss 1.7913"); at
    step 1 both ranks raise in DDP._pre_forward: "RuntimeError: Expected to have
    finished reduction in the prior iteration before starting a new one ...
    Parameter indices which did not receive grad for rank 0: 7 8" (the citation
    head's weight and bias; same for rank 1).  torchrun reports ChildFailedError;
    which rank it calls the first failure is a race (rank 1 in the recorded run).
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "unused", "citation_head"],
    "options": [],
}

SEED = 1789
VOCAB = 5000
N_CLAUSES = 2048
CLAUSE_TYPES = ("indemnification", "termination", "confidentiality",
                "governing_law", "limitation_of_liability", "assignment")
BATCH = 32
EPOCHS = 3
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "legal_clauses")


def make_corpus(n, seed):
    """Each clause type has its own topical token distribution; lengths vary 20..120."""
    g = torch.Generator().manual_seed(seed)
    topic_logits = torch.randn(len(CLAUSE_TYPES), VOCAB, generator=g) * 2.0
    topic_probs = torch.softmax(topic_logits, dim=1)
    labels = torch.randint(0, len(CLAUSE_TYPES), (n,), generator=g)
    cites = torch.rand(n, generator=g) < 0.3
    lengths = torch.randint(20, 121, (n,), generator=g)
    docs = []
    for i in range(n):
        toks = torch.multinomial(topic_probs[labels[i]], int(lengths[i]), replacement=True, generator=g)
        if cites[i]:
            toks[:3] = torch.tensor([11, 12, 13])       # "pursuant to section"
        docs.append(toks)
    return docs, labels, cites.float()


class ClauseDataset(Dataset):
    def __init__(self, docs, labels, cites):
        self.docs, self.labels, self.cites = docs, labels, cites

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, idx):
        return self.docs[idx], self.labels[idx], self.cites[idx]


def collate_bag(batch):
    docs, labels, cites = zip(*batch)
    offsets = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
    return torch.cat(docs), offsets, torch.stack(labels), torch.stack(cites)


class ClauseModel(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, dim, mode="mean")
        self.encoder = nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU())
        self.clause_head = nn.Linear(128, len(CLAUSE_TYPES))
        self.citation_head = nn.Linear(128, 1)

    def forward(self, tokens, offsets):
        h = self.encoder(self.embed(tokens, offsets))
        return self.clause_head(h), self.citation_head(h).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    docs, labels, cites = make_corpus(N_CLAUSES, SEED)
    ds = ClauseDataset(docs, labels, cites)
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, collate_fn=collate_bag)

    model = DDP(ClauseModel())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        for tokens, offsets, y, _cite in loader:
            clause_logits, _ = model(tokens, offsets)  # zoo: place
            loss = F.cross_entropy(clause_logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "clause_model.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
