"""A rating model for explicit feedback (stars): matrix factorization with side features and an
MLP over the two vectors, in the spirit of NeuMF (He et al., 2017) with biased MF's terms.

A user's vector is the sum of the embeddings of the user, their gender, occupation and age
bucket; a movie's vector is its embedding plus a linear map of its dense features (genres,
release year). The prediction adds four terms::

    mean_rating + user_bias[u] + movie_bias[m] + <user, movie> + mlp([user, movie])

The global bias starts at the data's mean rating and the per-row biases at 0, so the untrained
model is the global-mean predictor; the embeddings start small, so the dot product and the MLP
learn corrections to it. Every table is a plain ``nn.Embedding`` of a fixed size, so a
parameter server shards all of them by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from paramserver.models.dlrm import mlp


class RatingModel(nn.Module):
    """``forward(dense [B, num_dense] float, sparse [B, 5] int64) -> ratings [B]``.

    ``table_rows`` gives the rows of the user, movie, gender, occupation and age tables, in the
    order of ``sparse``'s columns (as :meth:`paramserver.data.movielens.MovieLens100k.table_rows`
    returns them).
    """

    def __init__(
        self,
        table_rows: Sequence[int],
        num_dense: int,
        embedding_dim: int = 16,
        hidden: tuple[int, ...] = (64,),
        mean_rating: float = 3.5,
        init_scale: float = 0.01,
    ):
        super().__init__()
        if len(table_rows) != 5:
            raise ValueError(f"table_rows: expected 5 tables, got {len(table_rows)}")
        num_users, num_movies, num_genders, num_occupations, num_ages = table_rows
        self.user = nn.Embedding(num_users, embedding_dim)
        self.movie = nn.Embedding(num_movies, embedding_dim)
        self.gender = nn.Embedding(num_genders, embedding_dim)
        self.occupation = nn.Embedding(num_occupations, embedding_dim)
        self.age = nn.Embedding(num_ages, embedding_dim)
        self.user_bias = nn.Embedding(num_users, 1)
        self.movie_bias = nn.Embedding(num_movies, 1)
        for table in (self.user, self.movie, self.gender, self.occupation, self.age):
            nn.init.normal_(table.weight, std=init_scale)
        for table in (self.user_bias, self.movie_bias):
            nn.init.zeros_(table.weight)
        self.movie_features = nn.Linear(num_dense, embedding_dim)
        nn.init.normal_(self.movie_features.weight, std=init_scale)
        nn.init.zeros_(self.movie_features.bias)
        self.mlp = mlp([2 * embedding_dim, *hidden, 1], final_activation=False)
        self.mean_rating = nn.Parameter(torch.tensor([float(mean_rating)]))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        users, movies = sparse[:, 0], sparse[:, 1]
        user = (
            self.user(users)
            + self.gender(sparse[:, 2])
            + self.occupation(sparse[:, 3])
            + self.age(sparse[:, 4])
        )
        movie = self.movie(movies) + self.movie_features(dense)
        dot = (user * movie).sum(dim=1)
        biases = self.user_bias(users).squeeze(1) + self.movie_bias(movies).squeeze(1)
        deep = self.mlp(torch.cat([user, movie], dim=1)).squeeze(1)
        return self.mean_rating + biases + dot + deep
