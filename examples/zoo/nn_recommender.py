"""A small DLRM-style click-through-rate recommender with inputs of mixed dtypes.

Three inputs:

* ``dense`` float32 [B, dense_features] -- numeric features, through a bottom MLP to [B, hidden];
* ``categorical`` int64 [B, tables] -- one id per categorical field, each looked up in its own
  nn.Embedding (tables=3, 128 rows each);
* ``history`` int64 [B, history_len] -- a padded bag of recently seen item ids (id 0 = padding),
  pooled with nn.EmbeddingBag(mode="mean", padding_idx=0).

The dense vector and the embeddings are concatenated, pairwise dot-product interactions are added,
and a top MLP (with dropout) gives one click logit per sample, output [B].

Loss: binary cross entropy with logits against float click labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Recommender(nn.Module):
    def __init__(self, dense_features: int, tables: int, rows: int, items: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.bottom = nn.Sequential(
            nn.Linear(dense_features, 2 * hidden),
            nn.ReLU(),
            nn.Linear(2 * hidden, hidden),
            nn.ReLU(),
        )
        self.embeddings = nn.ModuleList([nn.Embedding(rows, hidden) for _ in range(tables)])
        self.history = nn.EmbeddingBag(items, hidden, mode="mean", padding_idx=0)
        fields = tables + 2  # dense + categorical + history
        interactions = fields * (fields - 1) // 2
        self.top = nn.Sequential(
            nn.Linear(fields * hidden + interactions, 2 * hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(2 * hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        vectors = [self.bottom(dense)]
        for i, table in enumerate(self.embeddings):
            vectors.append(table(categorical[:, i]))
        vectors.append(self.history(history))
        stacked = torch.stack(vectors, dim=1)  # [B, fields, hidden]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, fields, fields]
        i, j = torch.triu_indices(stacked.size(1), stacked.size(1), offset=1)
        pairs = dots[:, i, j]  # [B, interactions]
        features = torch.cat([stacked.flatten(1), pairs], dim=1)
        return self.top(features).squeeze(1)


def build_model(
    dense_features: int = 8,
    tables: int = 3,
    rows: int = 128,
    items: int = 128,
    hidden: int = 32,
    dropout: float = 0.1,
    **_: object,
) -> nn.Module:
    return Recommender(dense_features, tables, rows, items, hidden, dropout)


def example_inputs(
    batch_size: int,
    dense_features: int = 8,
    tables: int = 3,
    rows: int = 128,
    items: int = 128,
    history_len: int = 16,
    **_: object,
):
    dense = torch.randn(batch_size, dense_features)
    categorical = torch.randint(0, rows, (batch_size, tables))
    history = torch.randint(0, items, (batch_size, history_len))  # zeros are padding
    return dense, categorical, history


def example_targets(batch_size: int, **_: object):
    return (torch.randint(0, 2, (batch_size,)).float(),)


def loss_fn(output, data):
    (clicks,) = data
    return F.binary_cross_entropy_with_logits(output, clicks)
